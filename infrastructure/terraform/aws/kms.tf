data "aws_caller_identity" "current" {}

data "aws_partition" "current" {}

locals {
  kms_key_arn = var.create_kms_key ? aws_kms_key.queue[0].arn : var.kms_key_arn
  encrypted   = local.kms_key_arn != null
}

data "aws_iam_policy_document" "kms" {
  count = var.create_kms_key ? 1 : 0

  statement {
    sid       = "AccountAdministers"
    actions   = ["kms:*"]
    resources = ["*"]
    principals {
      type        = "AWS"
      identifiers = ["arn:${data.aws_partition.current.partition}:iam::${data.aws_caller_identity.current.account_id}:root"]
    }
  }

  # SNS encrypts what it stores and what it sends to the (encrypted) queues.
  statement {
    sid       = "SnsUsesTheKey"
    actions   = ["kms:GenerateDataKey*", "kms:Decrypt"]
    resources = ["*"]
    principals {
      type        = "Service"
      identifiers = ["sns.amazonaws.com"]
    }
    condition {
      test     = "StringEquals"
      variable = "aws:SourceAccount"
      values   = [data.aws_caller_identity.current.account_id]
    }
  }

  # CloudWatch alarms read the encrypted queues' metrics without the key; nothing else needs it.
}

resource "aws_kms_key" "queue" {
  count = var.create_kms_key ? 1 : 0

  description             = "fastapi-workqueue topics and queues"
  enable_key_rotation     = true
  deletion_window_in_days = var.kms_deletion_window_days
  policy                  = data.aws_iam_policy_document.kms[0].json
  tags                    = var.tags

  lifecycle {
    precondition {
      condition     = var.kms_key_arn == null
      error_message = "Set either create_kms_key = true or kms_key_arn, not both."
    }
  }
}
