resource "aws_sns_topic" "topic" {
  for_each = local.topics

  name       = each.value.sns_name
  fifo_topic = each.value.is_fifo
  # The library sends the MessageID as the deduplication id: never deduplicate on content.
  content_based_deduplication = each.value.is_fifo ? false : null
  kms_master_key_id           = local.kms_key_arn

  tags = merge(var.tags, { "workqueue:topic" = each.key })
}

resource "aws_sns_topic_subscription" "subscription" {
  for_each = local.subscriptions

  topic_arn            = aws_sns_topic.topic[each.value.topic].arn
  protocol             = "sqs"
  endpoint             = aws_sqs_queue.queue[each.key].arn
  raw_message_delivery = each.value.raw_message_delivery
  filter_policy        = each.value.filter_policy_json
  filter_policy_scope  = each.value.filter_policy_json == null ? null : each.value.filter_policy_scope

  # SNS must be allowed to send to the queue before it confirms the subscription.
  depends_on = [aws_sqs_queue_policy.queue]
}
