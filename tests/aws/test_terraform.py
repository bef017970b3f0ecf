"""The Terraform module in infrastructure/terraform/aws: it parses, and what it reads exists.

Terraform itself cannot run here, so these checks are static: every ``.tf`` file parses with
python-hcl2; every manifest field the module reads is in the manifest's JSON Schema; every
``var.``, ``local.``, resource and data reference names something the module declares; every
``each.value.<field>`` names a field of the collection the block iterates.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import hcl2
import pytest

MODULE = Path(__file__).resolve().parents[2] / "infrastructure" / "terraform" / "aws"
TF_FILES = sorted(MODULE.glob("*.tf"))


def _plain(value: Any) -> Any:
    """python-hcl2's tree without its markers (``__is_block__``, comments) and with block labels unquoted."""
    if isinstance(value, dict):
        return {
            (k[1:-1] if len(k) > 1 and k[0] == k[-1] == '"' else k): _plain(v)
            for k, v in value.items() if k not in ("__is_block__", "__comments__", "__inline_comments__")
        }
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _load(path: Path) -> dict[str, Any]:
    with path.open(encoding="utf-8") as f:
        parsed: dict[str, Any] = _plain(hcl2.load(f))
    return parsed


def _text(value: Any) -> str:
    return json.dumps(value)


def _blocks(kind: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(type, name, body) of every ``resource`` or ``data`` block of the module."""
    found = []
    for path in TF_FILES:
        for entry in _load(path).get(kind, []):
            for rtype, named in entry.items():
                for name, body in named.items():
                    found.append((rtype, name, body))
    return found


def _all_text() -> str:
    return "\n".join(_text(_load(p)) for p in TF_FILES)


def _locals() -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for path in TF_FILES:
        for entry in _load(path).get("locals", []):
            merged.update(entry)
    return merged


def _schema() -> dict[str, Any]:
    from fastapi_workqueue.aws.manifest import manifest_schema

    return manifest_schema()


def _resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        ref = node["$ref"]
        assert ref.startswith("#/"), f"only local references are followed, got {ref}"
        target: Any = schema
        for part in ref[2:].split("/"):
            target = target[part]
        node = target
    return node


def _properties(schema: dict[str, Any], node: dict[str, Any]) -> set[str]:
    """The property names of an object schema, looking through $ref, anyOf/oneOf and arrays' items."""
    node = _resolve(schema, node)
    names = set(node.get("properties", {}))
    for key in ("anyOf", "oneOf", "allOf"):
        for alt in node.get(key, []):
            names |= _properties(schema, alt)
    if "items" in node:
        names |= _properties(schema, node["items"])
    return names


def _child(schema: dict[str, Any], node: dict[str, Any], name: str) -> dict[str, Any]:
    node = _resolve(schema, node)
    if name in node.get("properties", {}):
        return _resolve(schema, node["properties"][name])
    for key in ("anyOf", "oneOf", "allOf"):
        for alt in node.get(key, []):
            alt = _resolve(schema, alt)
            if name in _properties(schema, alt):
                return _child(schema, alt, name)
    if "items" in node:
        return _child(schema, node["items"], name)
    raise KeyError(name)


def test_the_module_has_its_files() -> None:
    names = {p.name for p in TF_FILES}
    assert {"versions.tf", "variables.tf", "manifest.tf", "sns.tf", "sqs.tf", "lambda.tf", "iam.tf",
            "outputs.tf", "alarms.tf", "kms.tf"} <= names
    assert (MODULE / "README.md").is_file()
    assert "terraform validate" in (MODULE / "README.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("path", TF_FILES, ids=lambda p: p.name)
def test_every_tf_file_parses(path: Path) -> None:
    parsed = _load(path)
    assert parsed, f"{path.name} parsed to nothing"


def test_only_manifest_tf_reads_the_manifest() -> None:
    for path in TF_FILES:
        text = path.read_text(encoding="utf-8")
        if path.name == "manifest.tf":
            assert "jsondecode(file(var.manifest_path))" in text
            continue
        assert "local.manifest." not in text and "jsondecode(file(" not in text, (
            f"{path.name} reads the manifest directly; read it in manifest.tf"
        )


def test_every_manifest_field_the_module_reads_is_in_the_schema() -> None:
    schema = _schema()
    text = (MODULE / "manifest.tf").read_text(encoding="utf-8")
    top = set(re.findall(r"\blocal\.manifest\.(\w+)", text))
    topic_fields = set(re.findall(r"\bt\.(\w+)", text))
    sub_fields = set(re.findall(r"\bs\.(\w+)", text))
    lambda_fields = set(re.findall(r"\bs\.lambda\.(\w+)", text))

    assert {"version", "region", "topics", "subscriptions"} <= top
    assert {"name", "sns_name", "is_fifo"} <= topic_fields
    assert {"max_attempts", "filter_policy", "lambda", "visibility_timeout_seconds"} <= sub_fields
    assert lambda_fields == {"batch_size", "maximum_batching_window_seconds", "timeout_seconds"}

    assert top <= _properties(schema, schema), f"not in the schema: {top - _properties(schema, schema)}"
    topics = _child(schema, schema, "topics")
    assert topic_fields <= _properties(schema, topics), topic_fields - _properties(schema, topics)
    subs = _child(schema, schema, "subscriptions")
    assert sub_fields <= _properties(schema, subs), sub_fields - _properties(schema, subs)
    lam = _child(schema, subs, "lambda")
    assert lambda_fields <= _properties(schema, lam), lambda_fields - _properties(schema, lam)


def test_every_variable_and_local_referenced_is_declared() -> None:
    declared_vars: set[str] = set()
    for path in TF_FILES:
        for entry in _load(path).get("variable", []):
            declared_vars |= set(entry)
    text = _all_text()
    used_vars = set(re.findall(r"\bvar\.(\w+)", text))
    assert used_vars <= declared_vars, f"undeclared variables: {used_vars - declared_vars}"
    unused = declared_vars - used_vars
    assert not unused, f"variables the module never reads: {unused}"
    used_locals = set(re.findall(r"\blocal\.(\w+)", text))
    assert used_locals <= set(_locals()), f"undeclared locals: {used_locals - set(_locals())}"


def test_every_resource_and_data_reference_is_declared() -> None:
    resources = {(t, n) for t, n, _ in _blocks("resource")}
    data = {(t, n) for t, n, _ in _blocks("data")}
    text = _all_text()
    for rtype, name in re.findall(r"(?<![\w.])(aws_\w+|terraform_data)\.(\w+)", text):
        assert (rtype, name) in resources, f"{rtype}.{name} is referenced but not declared"
    for rtype, name in re.findall(r"\bdata\.(\w+)\.(\w+)", text):
        assert (rtype, name) in data, f"data.{rtype}.{name} is referenced but not declared"


def _object_keys(expression: str, after: str) -> set[str]:
    """The keys of the first object constructor that follows ``after`` in a local's expression."""
    start = expression.index(after)
    body = expression[expression.index("{", start + len(after)) :]
    return set(re.findall(r"(?:^|[{,\s])(\w+)\s*=(?!=)", body))


def test_each_value_fields_exist_in_what_the_block_iterates() -> None:
    defined = _locals()
    sub_expr = str(defined["subscriptions"])
    topic_fields = _object_keys(str(defined["topics"]), "=>")
    sub_fields = _object_keys(sub_expr, "=>")
    lambda_fields = _object_keys(sub_expr, "lambda")
    assert {"queue_name", "dlq_name", "filter_policy_json", "lambda", "topic"} <= sub_fields
    assert {"batch_size", "timeout_seconds"} <= lambda_fields

    consumer_fields: set[str] = {"subscription", "function_name"}
    for path in TF_FILES:
        for entry in _load(path).get("variable", []):
            if "lambda_consumers" in entry:
                consumer_fields |= set(re.findall(r"(\w+)\s*=\s*optional", _text(entry["lambda_consumers"]["type"])))
    assert {"s3_bucket", "image_uri", "maximum_concurrency", "backoff_base_seconds"} <= consumer_fields

    checked = 0
    for kind in ("resource", "data"):
        for rtype, name, body in _blocks(kind):
            for_each = _text(body.get("for_each", ""))
            text = _text(body)
            used = set(re.findall(r"\beach\.value\.(\w+)", text))
            if "local.subscriptions" in for_each:
                allowed = sub_fields
            elif "local.topics" in for_each:
                allowed = topic_fields
            elif "local.lambda_consumers" in for_each:
                allowed = consumer_fields
                for field in re.findall(r"\beach\.value\.subscription\.(\w+)", text):
                    assert field in sub_fields, f"{rtype}.{name} reads subscription.{field}"
                for field in re.findall(r"\beach\.value\.subscription\.lambda\.(\w+)", text):
                    assert field in lambda_fields, f"{rtype}.{name} reads subscription.lambda.{field}"
            else:
                assert not used, f"{rtype}.{name} reads each.value without iterating a known collection"
                continue
            assert used <= allowed, f"{rtype}.{name} reads {used - allowed}"
            checked += 1
    assert checked >= 15


def test_queues_redrive_to_their_dlq_after_max_attempts_and_subscriptions_deliver_raw() -> None:
    blocks = {(t, n): body for t, n, body in _blocks("resource")}
    queue = _text(blocks[("aws_sqs_queue", "queue")])
    assert "maxReceiveCount" in queue and "each.value.max_receive_count" in queue
    assert "aws_sqs_queue.dlq[each.key].arn" in queue
    assert "each.value.visibility_timeout_seconds" in queue
    sub = _text(blocks[("aws_sns_topic_subscription", "subscription")])
    assert "each.value.raw_message_delivery" in sub and "each.value.filter_policy_json" in sub
    mapping = _text(blocks[("aws_lambda_event_source_mapping", "consumer")])
    assert "ReportBatchItemFailures" in mapping and "aws_lambda_alias.live" in mapping
    function = _text(blocks[("aws_lambda_function", "consumer")])
    assert "WORKQUEUE_SUBSCRIPTION_POLICY" in function
    outputs: set[str] = set()
    for path in TF_FILES:
        for entry in _load(path).get("output", []):
            outputs |= set(entry)
    assert {"binding_import", "app_policy_json", "worker_policy_json"} <= outputs


def test_binding_import_has_the_bindings_format_keys() -> None:
    for path in TF_FILES:
        for entry in _load(path).get("output", []):
            if "binding_import" in entry:
                text = _text(entry["binding_import"]["value"])
                for key in ("version", "region", "topics", "subscriptions", "arn", "queue_url", "queue_arn",
                            "dlq_url", "dlq_arn", "subscription_arn"):
                    assert re.search(rf"\b{key}\b", text), f"binding_import lacks {key}"
                return
    pytest.fail("no binding_import output")


def test_the_lambda_role_reaches_only_its_own_queue_dlq_and_log_group() -> None:
    blocks = {(t, n): body for t, n, body in _blocks("data")}
    resources: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "resources":
                    resources.extend(v if isinstance(v, list) else [v])
                else:
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(blocks[("aws_iam_policy_document", "consumer")])
    assert len(resources) == 4, resources
    for r in resources:
        assert any(own in r for own in (
            "aws_sqs_queue.queue[each.key].arn", "aws_sqs_queue.dlq[each.key].arn",
            "aws_cloudwatch_log_group.consumer[each.key].arn", "statement.value",
        )), f"the consumer role reaches {r}"
    assert "*" not in "".join(r.replace(":*", "") for r in resources)


def test_the_policy_the_module_sets_on_a_lambda_is_what_the_adapter_reads() -> None:
    from fastapi_workqueue.aws.lambda_handler import POLICY_ENV, SubscriptionPolicy

    text = (MODULE / "lambda.tf").read_text(encoding="utf-8")
    block = text[text.index(f"{POLICY_ENV} = jsonencode({{") :]
    block = block[: block.index("})")]
    keys = set(re.findall(r"^\s*(\w+)\s*=", block, re.M)) - {POLICY_ENV}
    fields = set(SubscriptionPolicy.model_fields)
    assert keys <= fields, f"the module sets {keys - fields}, which the adapter ignores"
    required = {name for name, f in SubscriptionPolicy.model_fields.items() if f.is_required()}
    assert required <= keys, f"the adapter needs {required - keys}, which the module does not set"
    assert fields - keys <= {"region"}, f"the module leaves out {fields - keys}"


def test_the_example_calls_the_module_with_a_fresh_manifest() -> None:
    from fastapi_workqueue import WorkQueueSettings
    from fastapi_workqueue.aws.manifest import build_manifest, validate_manifest
    from tests.apps.aws_app import queue

    example = MODULE / "examples" / "basic"
    manifest = json.loads((example / "manifest.json").read_text(encoding="utf-8"))
    validate_manifest(manifest)
    settings = WorkQueueSettings(aws_region="us-east-1", aws_lambda_subscriptions=["orders.archive"],
                                 aws_resource_prefix="")
    fresh = build_manifest(queue.topics.values(), queue.subscriptions.values(), settings)
    assert manifest == fresh, "export the example's manifest again (see examples/basic/main.tf)"

    [call] = _load(example / "main.tf")["module"]
    body = call["workqueue"]
    assert body["source"].strip('"') == "../.."
    module_vars: set[str] = set()
    for path in TF_FILES:
        for entry in _load(path).get("variable", []):
            module_vars |= set(entry)
    passed = set(body) - {"source"}
    assert passed <= module_vars, f"the example passes {passed - module_vars}, which the module does not take"
    # What the module's preconditions check at plan time.
    lambdas = {s["name"]: s for s in manifest["subscriptions"] if s["lambda"] is not None}
    assert set(body["lambda_consumers"]) <= set(lambdas)
    for s in lambdas.values():
        assert s["lambda"]["timeout_seconds"] <= s["visibility_timeout_seconds"]
