"""The AWS transport: SNS topics and SQS queues for ``Topic(transport="aws")``.

The core never imports this package: it finds :func:`.transport.create_transport` through the
``fastapi_workqueue.transports`` entry point. Needs the ``aws`` extra (aioboto3).
"""
