"""The AWS transport (SNS + SQS), its manifest and bindings, and the Lambda adapter.

Keep this module free of imports: ``fastapi_workqueue.aws.lambda_handler`` is loaded in Lambda
functions, which must not pull in the transport, the web framework or a database driver.
"""
