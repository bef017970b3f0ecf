# Policies for the roles that run the application. The module attaches them to nothing: attach
# app_policy_json to the role of the web app (publishes, operator views, validate-bindings) and
# worker_policy_json to the role of `workqueue work` processes (consume; follow-ups publish).

locals {
  topic_arns = [for t in aws_sns_topic.topic : t.arn]
  queue_arns = [for q in aws_sqs_queue.queue : q.arn]
  dlq_arns   = [for q in aws_sqs_queue.dlq : q.arn]

  consume_actions = [
    "sqs:ReceiveMessage",
    "sqs:DeleteMessage",
    "sqs:ChangeMessageVisibility",
    "sqs:GetQueueAttributes",
    "sqs:GetQueueUrl",
    # A subscription's pause is the queue's workqueue:status tag, read on every bindings refresh.
    "sqs:ListQueueTags",
  ]
}

data "aws_iam_policy_document" "worker" {
  dynamic "statement" {
    for_each = length(local.topic_arns) == 0 ? [] : [local.topic_arns]
    content {
      sid       = "PublishToTopics"
      actions   = ["sns:Publish"]
      resources = statement.value
    }
  }

  dynamic "statement" {
    for_each = length(local.queue_arns) == 0 ? [] : [local.queue_arns]
    content {
      sid       = "ConsumeQueues"
      actions   = local.consume_actions
      resources = statement.value
    }
  }

  # A handler's dead letter is sent to the DLQ by the consumer (keeping the MessageID and the reason).
  dynamic "statement" {
    for_each = length(local.dlq_arns) == 0 ? [] : [local.dlq_arns]
    content {
      sid       = "DeadLetterToDlqs"
      actions   = ["sqs:SendMessage", "sqs:GetQueueAttributes", "sqs:GetQueueUrl"]
      resources = statement.value
    }
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

data "aws_iam_policy_document" "app" {
  # Everything a worker may do: the app's host runs consumers and the outbox relay too.
  source_policy_documents = [data.aws_iam_policy_document.worker.json]

  # validate-bindings reads topics and subscriptions.
  dynamic "statement" {
    for_each = length(local.topic_arns) == 0 ? [] : [local.topic_arns]
    content {
      sid       = "ReadTopics"
      actions   = ["sns:GetTopicAttributes", "sns:ListSubscriptionsByTopic"]
      resources = statement.value
    }
  }

  dynamic "statement" {
    for_each = length(local.topic_arns) == 0 ? [] : [local.topic_arns]
    content {
      sid       = "ReadSubscriptions"
      actions   = ["sns:GetSubscriptionAttributes"]
      # Subscription ARNs are the topic ARN followed by ":<id>".
      resources = [for arn in statement.value : "${arn}:*"]
    }
  }

  # Pause and resume (workqueue pause/resume, the REST API) tag the queue with workqueue:status.
  dynamic "statement" {
    for_each = length(local.queue_arns) == 0 ? [] : [local.queue_arns]
    content {
      sid       = "PauseQueues"
      actions   = ["sqs:TagQueue", "sqs:ListQueueTags"]
      resources = statement.value
    }
  }

  # Operator views: dead letters are read from and discarded in the DLQ, replays go back to the source queue.
  dynamic "statement" {
    for_each = length(local.dlq_arns) == 0 ? [] : [concat(local.dlq_arns, local.queue_arns)]
    content {
      sid       = "OperateDeadLetters"
      actions   = ["sqs:ReceiveMessage", "sqs:DeleteMessage", "sqs:ChangeMessageVisibility", "sqs:SendMessage"]
      resources = statement.value
    }
  }
}
