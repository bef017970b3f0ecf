# Lambda consumers: one function (with a `live` alias and an SQS event source mapping) for every
# subscription whose manifest entry has a `lambda` object and whose artifact var.lambda_consumers gives.

locals {
  lambda_subscriptions = { for k, s in local.subscriptions : k => s if s.lambda != null }

  lambda_consumers = {
    for k, c in var.lambda_consumers : k => merge(c, {
      subscription  = local.lambda_subscriptions[k]
      function_name = substr(replace(trimsuffix(local.lambda_subscriptions[k].queue_name, ".fifo"), ".", "-"), 0, 64)
    }) if contains(keys(local.lambda_subscriptions), k)
  }
}

resource "terraform_data" "lambda_consumers" {
  input = keys(var.lambda_consumers)

  lifecycle {
    precondition {
      condition     = length(setsubtract(keys(var.lambda_consumers), keys(local.lambda_subscriptions))) == 0
      error_message = "lambda_consumers names ${join(", ", setsubtract(keys(var.lambda_consumers), keys(local.lambda_subscriptions)))}, which the manifest does not serve by Lambda; add it to WORKQUEUE_AWS_LAMBDA_SUBSCRIPTIONS and export again, or remove the entry."
    }
    precondition {
      condition     = length(distinct([for c in local.lambda_consumers : c.function_name])) == length(local.lambda_consumers)
      error_message = "Two Lambda consumers would get the same function name (queue names cut to 64 characters); shorten the subscription names."
    }
    precondition {
      condition     = alltrue([for c in local.lambda_consumers : c.subscription.lambda.timeout_seconds <= c.subscription.visibility_timeout_seconds])
      error_message = "A Lambda consumer's timeout exceeds its queue's visibility timeout (the subscription's lease); raise lease_seconds or lower the Lambda timeout and export again."
    }
    precondition {
      condition     = alltrue([for c in local.lambda_consumers : !c.subscription.is_fifo || c.subscription.lambda.batch_size <= 10])
      error_message = "A Lambda consumer of a FIFO queue takes at most 10 messages per batch; lower its batch_size and export again."
    }
  }
}

resource "aws_cloudwatch_log_group" "consumer" {
  for_each = local.lambda_consumers

  name              = "/aws/lambda/${each.value.function_name}"
  retention_in_days = each.value.log_retention_days
  tags              = merge(var.tags, { "workqueue:subscription" = each.key })
}

data "aws_iam_policy_document" "consumer_assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["lambda.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "consumer" {
  for_each = local.lambda_consumers

  name_prefix        = substr("${each.value.function_name}-", 0, 38)
  assume_role_policy = data.aws_iam_policy_document.consumer_assume.json
  tags               = merge(var.tags, { "workqueue:subscription" = each.key })
}

# The function may touch its own queue, its own dead-letter queue and its own log group: nothing else.
data "aws_iam_policy_document" "consumer" {
  for_each = local.lambda_consumers

  statement {
    sid = "ConsumeOwnQueue"
    actions = [
      "sqs:ReceiveMessage",
      "sqs:DeleteMessage",
      "sqs:ChangeMessageVisibility",
      "sqs:GetQueueAttributes",
    ]
    resources = [aws_sqs_queue.queue[each.key].arn]
  }

  statement {
    sid       = "DeadLetterToOwnDlq"
    actions   = ["sqs:SendMessage", "sqs:GetQueueAttributes"]
    resources = [aws_sqs_queue.dlq[each.key].arn]
  }

  statement {
    sid       = "WriteOwnLogGroup"
    actions   = ["logs:CreateLogStream", "logs:PutLogEvents"]
    resources = ["${aws_cloudwatch_log_group.consumer[each.key].arn}:*"]
  }

  dynamic "statement" {
    for_each = local.encrypted ? [local.kms_key_arn] : []
    content {
      sid       = "UseQueueKey"
      actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
      resources = [statement.value]
    }
  }
}

resource "aws_iam_role_policy" "consumer" {
  for_each = local.lambda_consumers

  name   = "workqueue-consumer"
  role   = aws_iam_role.consumer[each.key].id
  policy = data.aws_iam_policy_document.consumer[each.key].json
}

resource "aws_lambda_function" "consumer" {
  for_each = local.lambda_consumers

  function_name                  = each.value.function_name
  description                    = "fastapi-workqueue consumer of subscription ${each.key}"
  role                           = aws_iam_role.consumer[each.key].arn
  package_type                   = each.value.image_uri != null ? "Image" : "Zip"
  image_uri                      = each.value.image_uri
  s3_bucket                      = each.value.s3_bucket
  s3_key                         = each.value.s3_key
  s3_object_version              = each.value.s3_object_version
  handler                        = each.value.image_uri != null ? null : each.value.handler
  runtime                        = each.value.image_uri != null ? null : each.value.runtime
  architectures                  = each.value.architectures
  memory_size                    = each.value.memory_size
  timeout                        = each.value.subscription.lambda.timeout_seconds
  reserved_concurrent_executions = each.value.reserved_concurrency
  layers                         = each.value.image_uri != null ? null : each.value.layers
  publish                        = true

  environment {
    variables = merge(each.value.environment, {
      # Read by fastapi_workqueue.aws.lambda_handler.sqs_handler: the subscription's policy,
      # frozen at apply time (a policy change needs a new export and apply).
      WORKQUEUE_SUBSCRIPTION_POLICY = jsonencode({
        version                    = 1
        name                       = each.key
        topic                      = each.value.subscription.topic
        handler_key                = each.value.subscription.handler_key
        partition_mode             = each.value.subscription.partition_mode
        is_fifo                    = each.value.subscription.is_fifo
        max_attempts               = each.value.subscription.max_attempts
        lease_seconds              = each.value.subscription.visibility_timeout_seconds
        backoff_base_seconds       = each.value.backoff_base_seconds
        backoff_max_seconds        = each.value.backoff_max_seconds
        max_processing_seconds     = each.value.max_processing_seconds
        queue_url                  = aws_sqs_queue.queue[each.key].url
        dlq_url                    = aws_sqs_queue.dlq[each.key].url
      })
    })
  }

  tags = merge(var.tags, { "workqueue:subscription" = each.key })

  depends_on = [aws_iam_role_policy.consumer, aws_cloudwatch_log_group.consumer]
}

resource "aws_lambda_alias" "live" {
  for_each = local.lambda_consumers

  name             = "live"
  function_name    = aws_lambda_function.consumer[each.key].function_name
  function_version = aws_lambda_function.consumer[each.key].version
}

resource "aws_lambda_event_source_mapping" "consumer" {
  for_each = local.lambda_consumers

  event_source_arn = aws_sqs_queue.queue[each.key].arn
  function_name    = aws_lambda_alias.live[each.key].arn
  batch_size       = each.value.subscription.lambda.batch_size
  # Batching windows are not supported on FIFO queues.
  maximum_batching_window_in_seconds = each.value.subscription.is_fifo ? null : each.value.subscription.lambda.maximum_batching_window_seconds
  function_response_types            = ["ReportBatchItemFailures"]

  dynamic "scaling_config" {
    for_each = each.value.maximum_concurrency == null ? [] : [each.value.maximum_concurrency]
    content {
      maximum_concurrency = scaling_config.value
    }
  }

  depends_on = [aws_iam_role_policy.consumer]
}
