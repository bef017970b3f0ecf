resource "aws_sqs_queue" "dlq" {
  for_each = local.subscriptions

  name                        = each.value.dlq_name
  fifo_queue                  = each.value.is_fifo
  content_based_deduplication = each.value.is_fifo ? false : null
  message_retention_seconds   = var.dlq_retention_seconds
  kms_master_key_id           = local.kms_key_arn
  sqs_managed_sse_enabled     = local.encrypted ? null : true

  tags = merge(var.tags, { "workqueue:subscription" = each.key, "workqueue:role" = "dead-letter" })
}

resource "aws_sqs_queue" "queue" {
  for_each = local.subscriptions

  name                        = each.value.queue_name
  fifo_queue                  = each.value.is_fifo
  content_based_deduplication = each.value.is_fifo ? false : null
  deduplication_scope         = each.value.is_fifo && var.fifo_high_throughput ? "messageGroup" : null
  fifo_throughput_limit       = each.value.is_fifo && var.fifo_high_throughput ? "perMessageGroupId" : null
  visibility_timeout_seconds  = each.value.visibility_timeout_seconds
  message_retention_seconds   = each.value.message_retention_seconds
  receive_wait_time_seconds   = 20
  kms_master_key_id           = local.kms_key_arn
  sqs_managed_sse_enabled     = local.encrypted ? null : true

  redrive_policy = jsonencode({
    deadLetterTargetArn = aws_sqs_queue.dlq[each.key].arn
    maxReceiveCount     = each.value.max_receive_count
  })

  tags = merge(var.tags, { "workqueue:subscription" = each.key, "workqueue:role" = "source" })

  # The library keeps a subscription's pause in this tag (TagQueue); an apply must not undo it.
  lifecycle {
    ignore_changes = [tags["workqueue:status"]]
  }
}

# Only the subscription's own queue may dead-letter into its DLQ.
resource "aws_sqs_queue_redrive_allow_policy" "dlq" {
  for_each = local.subscriptions

  queue_url = aws_sqs_queue.dlq[each.key].id
  redrive_allow_policy = jsonencode({
    redrivePermission = "byQueue"
    sourceQueueArns   = [aws_sqs_queue.queue[each.key].arn]
  })
}

data "aws_iam_policy_document" "queue" {
  for_each = local.subscriptions

  statement {
    sid       = "TopicSendsToQueue"
    actions   = ["sqs:SendMessage"]
    resources = [aws_sqs_queue.queue[each.key].arn]
    principals {
      type        = "Service"
      identifiers = ["sns.amazonaws.com"]
    }
    condition {
      test     = "ArnEquals"
      variable = "aws:SourceArn"
      values   = [aws_sns_topic.topic[each.value.topic].arn]
    }
  }
}

resource "aws_sqs_queue_policy" "queue" {
  for_each = local.subscriptions

  queue_url = aws_sqs_queue.queue[each.key].id
  policy    = data.aws_iam_policy_document.queue[each.key].json
}
