variable "manifest_path" {
  description = "Path of the manifest written by `workqueue export-topology --transport aws --output manifest.json`."
  type        = string
}

variable "region" {
  description = "The AWS region; must equal the manifest's region (the queue's aws_region setting)."
  type        = string
}

variable "tags" {
  description = "Tags added to every resource the module creates."
  type        = map(string)
  default     = {}
}

variable "create_kms_key" {
  description = "Create a customer managed KMS key and encrypt the topics and queues with it."
  type        = bool
  default     = false
}

variable "kms_key_arn" {
  description = "An existing KMS key to encrypt the topics and queues with (its policy must let sns.amazonaws.com use it). Leave null for SQS managed encryption and unencrypted topics."
  type        = string
  default     = null
}

variable "kms_deletion_window_days" {
  description = "Waiting period before a key created by the module is deleted."
  type        = number
  default     = 30

  validation {
    condition     = var.kms_deletion_window_days >= 7 && var.kms_deletion_window_days <= 30
    error_message = "kms_deletion_window_days must be between 7 and 30."
  }
}

variable "dlq_retention_seconds" {
  description = "How long a dead-letter queue keeps a message (the SQS maximum by default: 14 days)."
  type        = number
  default     = 1209600

  validation {
    condition     = var.dlq_retention_seconds >= 60 && var.dlq_retention_seconds <= 1209600
    error_message = "dlq_retention_seconds must be between 60 and 1209600 (14 days)."
  }
}

variable "fifo_high_throughput" {
  description = "Use high-throughput FIFO queues (deduplication and throughput per message group, i.e. per partition key)."
  type        = bool
  default     = true
}

variable "alarm_actions" {
  description = "ARNs notified when an alarm fires (for example an SNS topic of the operations team)."
  type        = list(string)
  default     = []
}

variable "ok_actions" {
  description = "ARNs notified when an alarm returns to OK."
  type        = list(string)
  default     = []
}

variable "dlq_depth_alarm_threshold" {
  description = "A subscription's alarm fires when its dead-letter queue holds more than this many messages."
  type        = number
  default     = 0
}

variable "oldest_message_age_alarm_seconds" {
  description = "A subscription's alarm fires when the oldest message in its queue is older than this; per subscription in oldest_message_age_alarm_overrides."
  type        = number
  default     = 900
}

variable "oldest_message_age_alarm_overrides" {
  description = "Per-subscription thresholds (seconds) for the oldest-message-age alarm, keyed by subscription name."
  type        = map(number)
  default     = {}
}

variable "alarm_evaluation_periods" {
  description = "Consecutive one-minute periods over the threshold before an alarm fires."
  type        = number
  default     = 5
}

variable "lambda_consumers" {
  description = <<-EOT
    The artifact of each subscription served by Lambda (those whose manifest entry has a `lambda` object),
    keyed by subscription name. Give s3_bucket + s3_key (a zip) or image_uri (a container image).
    backoff_base_seconds / backoff_max_seconds are the subscription's retry backoff (the manifest does
    not carry them; keep them equal to the Subscription's).
  EOT
  type = map(object({
    s3_bucket               = optional(string)
    s3_key                  = optional(string)
    s3_object_version       = optional(string)
    image_uri               = optional(string)
    handler                 = optional(string, "app.handler")
    runtime                 = optional(string, "python3.12")
    architectures           = optional(list(string), ["arm64"])
    memory_size             = optional(number, 256)
    maximum_concurrency     = optional(number)
    reserved_concurrency    = optional(number, -1)
    backoff_base_seconds    = optional(number, 1)
    backoff_max_seconds     = optional(number, 300)
    max_processing_seconds  = optional(number)
    environment             = optional(map(string), {})
    layers                  = optional(list(string), [])
    log_retention_days      = optional(number, 30)
  }))
  default = {}

  validation {
    condition = alltrue([
      for name, c in var.lambda_consumers :
      (c.image_uri != null) != (c.s3_bucket != null && c.s3_key != null)
    ])
    error_message = "Each lambda_consumers entry needs either s3_bucket and s3_key (a zip) or image_uri (a container image), not both."
  }

  validation {
    condition = alltrue([
      for name, c in var.lambda_consumers :
      c.maximum_concurrency == null ? true : (c.maximum_concurrency >= 2 && c.maximum_concurrency <= 1000)
    ])
    error_message = "lambda_consumers maximum_concurrency must be between 2 and 1000 (SQS event source limits), or left unset."
  }
}
