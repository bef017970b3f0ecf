# Every read of the manifest happens in this file: the rest of the module uses local.topics and
# local.subscriptions. tests/aws/test_terraform.py checks each field read here against the
# manifest's JSON Schema (fastapi_workqueue/aws/manifest.schema.json).

locals {
  manifest = jsondecode(file(var.manifest_path))

  manifest_version = local.manifest.version
  manifest_region  = local.manifest.region

  topics = {
    for t in local.manifest.topics : t.name => {
      name     = t.name
      sns_name = t.sns_name
      is_fifo  = t.is_fifo
    }
  }

  subscriptions = {
    for s in local.manifest.subscriptions : s.name => {
      name                       = s.name
      topic                      = s.topic
      handler_key                = s.handler_key
      queue_name                 = s.queue_name
      dlq_name                   = s.dlq_name
      is_fifo                    = s.is_fifo
      partition_mode             = s.partition_mode
      max_attempts               = s.max_attempts
      max_receive_count          = s.max_receive_count
      visibility_timeout_seconds = s.visibility_timeout_seconds
      message_retention_seconds  = s.message_retention_seconds
      raw_message_delivery       = s.raw_message_delivery
      filter_policy_json         = s.filter_policy == null ? null : jsonencode(s.filter_policy)
      filter_policy_scope        = s.filter_policy_scope
      lambda = s.lambda == null ? null : {
        batch_size                      = s.lambda.batch_size
        maximum_batching_window_seconds = s.lambda.maximum_batching_window_seconds
        timeout_seconds                 = s.lambda.timeout_seconds
      }
    }
  }
}

# Refuses a manifest this module does not understand, or one exported for another region.
resource "terraform_data" "manifest" {
  input = local.manifest_version

  lifecycle {
    precondition {
      condition     = local.manifest_version == 1
      error_message = "The manifest is version ${local.manifest_version}; this module reads version 1. Upgrade the module or export with the matching fastapi-workqueue."
    }
    precondition {
      condition     = local.manifest_region == var.region
      error_message = "The manifest was exported for region ${local.manifest_region} but var.region is ${var.region}; set WORKQUEUE_AWS_REGION and var.region to the same region and export again."
    }
    precondition {
      condition     = alltrue([for s in local.subscriptions : contains(keys(local.topics), s.topic)])
      error_message = "A subscription in the manifest names a topic the manifest does not list; export the manifest again."
    }
    precondition {
      condition     = alltrue([for s in local.subscriptions : s.is_fifo == local.topics[s.topic].is_fifo])
      error_message = "A subscription's is_fifo differs from its topic's; SNS FIFO topics deliver only to FIFO queues. Export the manifest again."
    }
  }
}
