output "binding_import" {
  description = "The bindings: `terraform output -json binding_import > bindings.json`, then `workqueue import-bindings bindings.json`."
  value = {
    version = 1
    region  = local.manifest_region
    topics = {
      for k, t in aws_sns_topic.topic : k => { arn = t.arn }
    }
    subscriptions = {
      for k, s in local.subscriptions : k => {
        queue_url        = aws_sqs_queue.queue[k].url
        queue_arn        = aws_sqs_queue.queue[k].arn
        dlq_url          = aws_sqs_queue.dlq[k].url
        dlq_arn          = aws_sqs_queue.dlq[k].arn
        subscription_arn = aws_sns_topic_subscription.subscription[k].arn
      }
    }
  }
}

output "app_policy_json" {
  description = "IAM policy for the application's role: publish, consume, operate dead letters, validate bindings."
  value       = data.aws_iam_policy_document.app.json
}

output "worker_policy_json" {
  description = "IAM policy for worker roles (`workqueue work`): consume, dead-letter, publish follow-ups."
  value       = data.aws_iam_policy_document.worker.json
}

output "kms_key_arn" {
  description = "The key the topics and queues are encrypted with, or null."
  value       = local.kms_key_arn
}

output "lambda_function_arns" {
  description = "The Lambda consumers' function ARNs, keyed by subscription name."
  value       = { for k, f in aws_lambda_function.consumer : k => f.arn }
}

output "lambda_alias_arns" {
  description = "The `live` aliases the SQS event sources invoke, keyed by subscription name."
  value       = { for k, a in aws_lambda_alias.live : k => a.arn }
}

output "lambda_subscriptions_without_consumer" {
  description = "Subscriptions the manifest serves by Lambda that have no lambda_consumers entry (deployed another way, or forgotten)."
  value       = sort(setsubtract(keys(local.lambda_subscriptions), keys(var.lambda_consumers)))
}
