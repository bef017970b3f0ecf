#!/usr/bin/env python3
"""The server's share of a publish, statement by statement: pgbench (a C client, one connection)
calls the shipped publish routines and cut-down copies of them, and the backend's CPU per call is
read from ``/proc/<pid>/schedstat`` (bench/README.md, "What bounds the remaining targets").

    .venv/bin/python bench/experiments/publish_sql_split.py                # 3 turns of 6 s per variant
    .venv/bin/python bench/experiments/publish_sql_split.py --seconds 10 --turns 5

One message per call (the single publish):

* ``two inserts``: a function with the same settings as ours (SECURITY DEFINER, generic plans, no
  sequential scans) that inserts the message and one delivery, every value a constant;
* ``+ topic and subscriptions read``: the message INSERT carries the topic guard, the deliveries
  come from the topic's subscriptions (quiet ``publish_one``'s two statements, without the list
  of subscriptions to wake);
* ``+ wake-up list``: the deliveries' INSERT in a CTE whose RETURNING gives that list;
* ``publish_one`` as shipped, quiet (``p_quiet``) and not (then it also notifies).

Calls of 500 (``workqueue.publish``): without attributes, one attribute per item (each parsed),
the same attribute given once (an array of one), and the last two again without the
``message_job`` search index.

The database (``--database``, default ``bench_publish_sql_split``, on ``$BENCH_PG_URL`` or the local
server, which must run on this machine, with ``pgbench`` on the PATH) is dropped and recreated at
the start; the tables are emptied before every run.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from probe_support import add_database_options, figures, fresh_database, medians, one_topic_queue, server_cpu

TOPIC = "split.sql"
HASH = "'" + "ab" * 32 + "'"
SETTINGS = ("LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp "
            "SET plan_cache_mode = force_generic_plan SET enable_seqscan = off")
MESSAGE_GUARDED = f"""INSERT INTO workqueue.message AS m (id, topic, attributes, payload, content_hash)
    SELECT p_id, '{TOPIC}', '{{}}', '{{"i":1}}', {HASH} FROM workqueue.topic t
    WHERE t.name = '{TOPIC}' AND t.retired_at IS NULL ON CONFLICT (id) DO NOTHING;"""
DELIVERIES = f"""INSERT INTO workqueue.delivery (subscription_id, message_id, partition_key, key_mode,
        max_attempts, backoff_base_seconds, backoff_max_seconds, backoff_schedule, visible_at, priority)
    SELECT s.id, p_id, NULL, 0, s.max_attempts, s.backoff_base_seconds, s.backoff_max_seconds, NULL, now(), 0
    FROM workqueue.subscription s
    WHERE s.topic = '{TOPIC}' AND s.retired_at IS NULL
      AND (s.filter IS NULL OR workqueue.filter_matches(s.filter, NULL))
    ORDER BY s.id"""
VARIANTS = {
    "two_inserts": f"""BEGIN
        INSERT INTO workqueue.message (id, topic, attributes, payload, content_hash)
        VALUES (p_id, '{TOPIC}', '{{}}', '{{"i":1}}', {HASH});
        INSERT INTO workqueue.delivery (subscription_id, message_id, key_mode, max_attempts,
                                        backoff_base_seconds, backoff_max_seconds, visible_at)
        VALUES (p_sid, p_id, 0, 5, 1, 300, now());
    END""",
    "guarded": f"BEGIN {MESSAGE_GUARDED} {DELIVERIES}; END",
    "wake_list": f"""DECLARE v_wake integer[];
    BEGIN {MESSAGE_GUARDED}
        WITH nd AS ({DELIVERIES} RETURNING subscription_id)
        SELECT array_agg(nd.subscription_id ORDER BY nd.subscription_id) INTO v_wake FROM nd;
    END""",
}
ONE = (f"(p_topic => '{TOPIC}', p_message_id => gen_random_uuid(), p_partition_key => NULL, p_attributes => NULL, "
       f"p_payload => '{{\"i\":1}}', p_payload_ref => NULL, p_correlation_id => NULL, p_content_hash => {HASH}, "
       "p_delay => NULL, p_not_before => NULL, p_max_attempts => NULL, p_backoff_schedule => NULL, "
       "p_envelope_bytes => 7)")
JOB = '{"job":"bench.noop"}'
PAYLOAD = """'{"i":1}'"""


def batch_call(attributes: str) -> str:
    def column(value: str) -> str:
        return f"(SELECT array_agg({value}) FROM generate_series(1, 500) g)"

    return (f"SELECT count(*) FROM workqueue.publish('{TOPIC}', {column('gen_random_uuid()')}, NULL, {attributes}, "
            f"{column(PAYLOAD + '::text')}, NULL, NULL, {column(HASH + '::text')}, NULL, NULL, "
            f"NULL, NULL, NULL, NULL, {column('7')}, NULL);")


PER_ITEM = f"(SELECT array_agg(format('{JOB}', g)) FROM generate_series(1, 500) g)::jsonb[]"
CALLS = {
    "one message: two inserts": "SELECT split.two_inserts(gen_random_uuid(), :sid);",
    "one message: + topic and subscriptions read": "SELECT split.guarded(gen_random_uuid(), :sid);",
    "one message: + wake-up list": "SELECT split.wake_list(gen_random_uuid(), :sid);",
    "one message: publish_one quiet": f"SELECT * FROM workqueue.publish_one{ONE[:-1]}, p_quiet => true);",
    "one message: publish_one": f"SELECT * FROM workqueue.publish_one{ONE};",
    "500: no attributes": batch_call("NULL"),
    "500: one attribute per item": batch_call(PER_ITEM),
    "500: the attribute given once": batch_call(f"ARRAY['{JOB}'::jsonb]"),
}
WITHOUT_INDEX = ("500: one attribute per item", "500: the attribute given once")


def pgbench(dsn: str, script: str, seconds: float, sid: int) -> tuple[subprocess.Popen[str], Path]:
    path = Path(tempfile.mkstemp(suffix=".sql")[1])
    path.write_text(script.replace(":sid", str(sid)) + "\n")
    command = ["pgbench", "-n", "-M", "prepared", "-c", "1", "-T", str(int(seconds)), "-f", str(path), dsn]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), path


async def measure(admin: asyncpg.Connection, dsn: str, database: str, script: str, seconds: float,
                  sid: int) -> dict[str, float]:
    """One pgbench run of ``script``: its latency and the backend's CPU per call over the middle
    of the run (from 0.5 s in to 1 s before its end)."""
    proc, path = pgbench(dsn, script, seconds, sid)
    try:
        await asyncio.sleep(0.5)
        [pid] = [r["pid"] for r in await admin.fetch(
            "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND application_name = 'pgbench'", database)]
        c0, t0 = server_cpu([pid]), time.perf_counter()
        await asyncio.sleep(seconds - 1.5)
        cpu, spent = server_cpu([pid]) - c0, time.perf_counter() - t0
        out, _ = await asyncio.to_thread(proc.communicate)
    finally:
        path.unlink()
    if proc.returncode != 0:
        raise RuntimeError(f"pgbench failed: {out}")
    tps = float(re.search(r"tps = ([0-9.]+)", out).group(1))  # type: ignore[union-attr]
    latency = float(re.search(r"latency average = ([0-9.]+) ms", out).group(1))  # type: ignore[union-attr]
    return {"latency_ms": latency, "calls_per_s": tps, "server_cpu_us": cpu / (tps * spent) * 1e6}


async def main(args: argparse.Namespace) -> None:
    admin, dsn = await fresh_database(args.url, args.database)
    queue = await one_topic_queue(dsn, TOPIC, "split-sql")
    await queue.close()
    conn = await asyncpg.connect(dsn)
    await conn.execute("CREATE SCHEMA split")
    for name, body in VARIANTS.items():
        await conn.execute(f"CREATE FUNCTION split.{name}(p_id uuid, p_sid integer) RETURNS void {SETTINGS} "
                           f"AS $body$ {body} $body$")
    sid = await conn.fetchval("SELECT id FROM workqueue.subscription WHERE topic = $1", TOPIC)
    message_job = await conn.fetchval("SELECT pg_get_indexdef('workqueue.message_job'::regclass)")  # as migrated
    runs = [(name, script, True) for name, script in CALLS.items()]
    runs += [(f"{name}, no message_job index", CALLS[name], False) for name in WITHOUT_INDEX]
    results: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in runs}
    try:
        for turn in range(args.turns):
            for name, script, indexed in runs:
                await conn.execute("TRUNCATE workqueue.delivery, workqueue.message CASCADE")
                exists = await conn.fetchval("SELECT to_regclass('workqueue.message_job') IS NOT NULL")
                if indexed and not exists:
                    await conn.execute(message_job)
                elif exists and not indexed:
                    await conn.execute("DROP INDEX workqueue.message_job")
                got = await measure(admin, dsn, args.database, script, args.seconds, sid)
                results[name].append(got)
                print(f"turn {turn + 1} {name:55s} {figures(got, 2)}", flush=True)
    finally:
        await conn.close()
        await admin.close()
    print(f"medians of {args.turns} turns, per call (a call of 500 is 500 messages):")
    for name, got in medians(results).items():
        print(f"  {name:55s} {figures(got, 2)}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_database_options(ap, "bench_publish_sql_split")
    ap.add_argument("--seconds", type=float, default=6.0, help="length of each pgbench run")
    ap.add_argument("--turns", type=int, default=3)
    asyncio.run(main(ap.parse_args()))
