# Calling the module from an infrastructure repository. The manifest beside this file is what
# `workqueue export-topology --transport aws --app tests.apps.aws_app:queue` writes with
# WORKQUEUE_AWS_REGION=us-east-1 and WORKQUEUE_AWS_LAMBDA_SUBSCRIPTIONS='["orders.archive"]'.

terraform {
  required_version = ">= 1.5.0"
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.40"
    }
  }
}

provider "aws" {
  region = "us-east-1"
}

resource "aws_sns_topic" "ops_alerts" {
  name = "ops-alerts"
}

module "workqueue" {
  source = "../.."

  manifest_path  = "${path.module}/manifest.json"
  region         = "us-east-1"
  create_kms_key = true
  alarm_actions  = [aws_sns_topic.ops_alerts.arn]
  tags           = { team = "orders" }

  lambda_consumers = {
    "orders.archive" = {
      s3_bucket           = "acme-artifacts"
      s3_key              = "workqueue/orders-archive/0123456789ab.zip"
      maximum_concurrency = 10
    }
  }
}

output "binding_import" {
  value = module.workqueue.binding_import
}

output "app_policy_json" {
  value = module.workqueue.app_policy_json
}

output "worker_policy_json" {
  value = module.workqueue.worker_policy_json
}
