"""The AWS transport (SNS + SQS), its manifest and bindings, and the Lambda adapter.

The core never imports this package: it finds :func:`.transport.create_transport` through the
``fastapi_workqueue.transports`` entry point. Needs the ``aws`` extra (aioboto3).

Keep this module free of imports: ``fastapi_workqueue.aws.lambda_handler`` is loaded in Lambda
functions, which must not pull in the transport, the web framework or a database driver.
"""
