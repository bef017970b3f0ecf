resource "aws_cloudwatch_metric_alarm" "dlq_depth" {
  for_each = local.subscriptions

  alarm_name          = "${each.value.dlq_name}-depth"
  alarm_description   = "Dead letters of subscription ${each.key}: inspect with `workqueue dead-letters`, then replay or discard."
  namespace           = "AWS/SQS"
  metric_name         = "ApproximateNumberOfMessagesVisible"
  dimensions          = { QueueName = aws_sqs_queue.dlq[each.key].name }
  statistic           = "Maximum"
  period              = 60
  evaluation_periods  = 1
  comparison_operator = "GreaterThanThreshold"
  threshold           = var.dlq_depth_alarm_threshold
  treat_missing_data  = "notBreaching"
  alarm_actions       = var.alarm_actions
  ok_actions          = var.ok_actions

  tags = var.tags
}

resource "aws_cloudwatch_metric_alarm" "oldest_message_age" {
  for_each = local.subscriptions

  alarm_name          = "${each.value.queue_name}-oldest-message-age"
  alarm_description   = "The oldest message of subscription ${each.key} waits too long: its consumers are stopped, too few or failing."
  namespace           = "AWS/SQS"
  metric_name         = "ApproximateAgeOfOldestMessage"
  dimensions          = { QueueName = aws_sqs_queue.queue[each.key].name }
  statistic           = "Maximum"
  period              = 60
  evaluation_periods  = var.alarm_evaluation_periods
  comparison_operator = "GreaterThanThreshold"
  threshold           = lookup(var.oldest_message_age_alarm_overrides, each.key, var.oldest_message_age_alarm_seconds)
  treat_missing_data  = "notBreaching"
  alarm_actions       = var.alarm_actions
  ok_actions          = var.ok_actions

  tags = var.tags
}
