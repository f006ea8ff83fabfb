"""Read a ``tree: auto`` decision trace (``VLLM_UNIVER_AUTO_TRACE``) against what the
steps measured: per batch size and kind of step, the measured tokens per second
beside the rate the choice predicted for it.

    VLLM_UNIVER_AUTO_TRACE=/tmp/trace.jsonl python -m benchmarks.serving --configs auto ...
    python -m benchmarks.sizer_trace /tmp/trace.jsonl

Record i is decision i, made during step k's target forward. Its cut's period
runs from the end of step k's verification to the end of step k + 1's (the
``verified`` stamps, as the sizer times it: the first stamp after each decision):
the drafting of decision i's trees, step k + 1's target forward and their
verification (record i + 1's ``target_tokens``, ``draft_tokens``,
``chunk_tokens``). The tokens those trees yielded show in record i + 2's
``tokens`` (each request's committed tokens, counted before step k + 2's
verification). Kinds: "plain" (no request drafted), "spec" (every request
drafted at one depth), "mixed" (some requests plain), "+chunk" (a catch-up chunk
ran), "+prefill" (the target ran more rows than a decode step of the batch),
"+join" / "+change" (requests joined, or left: the tokens do not pair).
Several engines (servers run in turn) may append to one trace: each engine's
records (its ``pid``) are paired on their own.
"""

from __future__ import annotations

import argparse
import bisect
import json
from collections import defaultdict

import numpy as np


def steps(records: list[dict]) -> list[dict]:
    """One entry per decision with a measured period: its kind, and the tokens its
    trees yielded where the batch stayed the same over the next two decisions (None
    where requests joined or left: those periods also ran a prefill or a finish)."""
    stamps = sorted({r["verified"] for r in records if r.get("verified") is not None})

    def period(i: int) -> float | None:
        """Seconds from the first verification's end after decision i to the first after i + 1."""
        if not stamps:  # an older trace: between the decisions
            return records[i + 1]["t"] - records[i]["t"]
        begin, end = (bisect.bisect_right(stamps, records[j]["t"]) for j in (i, i + 1))
        return stamps[end] - stamps[begin] if end < len(stamps) else None

    out = []
    for i in range(len(records) - 1):
        now, nxt = records[i], records[i + 1]
        seconds = period(i)
        if seconds is None:
            break
        depths = np.asarray(now["depths"])
        kind = "plain" if not depths.any() else ("spec" if depths.min() == depths.max() else "mixed")
        if nxt["chunk_tokens"]:
            kind += "+chunk"
        if nxt["target_tokens"] > now["decode_rows"]:
            kind += "+prefill"
        ids = now["req_ids"]
        gained = None
        if i + 2 < len(records) and nxt["req_ids"] == ids and records[i + 2]["req_ids"] == ids:
            gained = int(np.sum(np.asarray(records[i + 2]["tokens"]) - np.asarray(nxt["tokens"])))
        elif nxt["req_ids"] != ids:
            kind += "+join" if set(nxt["req_ids"]) > set(ids) else "+change"
        priced = None
        if now["rates"] is not None:
            rates = now["rates"]
            priced = {"plain": max(r[0] for r in rates), "best": max(max(r[1:], default=0.0) for r in rates)}
            if now.get("priced") is not None:  # the choice's own expected tokens and seconds
                priced["tokens"], priced["seconds"] = now["priced"]
        timers = {k: v - now.get("timers", {}).get(k, 0.0) for k, v in nxt.get("timers", {}).items()}
        out.append(
            {
                "batch": now["batch"],
                "kind": kind,
                "depth": int(depths.max(initial=0)),
                "seconds": seconds,
                "tokens": gained,
                "priced": priced,
                "timers": timers,
            }
        )
    return out


def summarise(entries: list[dict]) -> list[str]:
    groups = defaultdict(list)
    for e in entries:
        groups[(e["batch"], e["kind"])].append(e)
    sections = sorted({k for e in entries for k in e["timers"]})
    total = sum(e["seconds"] for e in entries)
    lines = [
        f"{len(entries)} periods, {total:.1f} s.",
        "",
        "| batch | kind | steps | share of time | ms / step (median) | tokens / step | measured tok/s "
        "| priced plain | priced best | choice's tokens / ms priced |" + "".join(f" {s} ms |" for s in sections),
        "|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(sections),
    ]
    for (batch, kind), es in sorted(groups.items()):
        seconds = sum(e["seconds"] for e in es)
        paired = [e for e in es if e["tokens"] is not None]
        tokens = sum(e["tokens"] for e in paired)
        paired_seconds = sum(e["seconds"] for e in paired)
        priced = [e["priced"] for e in es if e["priced"]]
        plain = f"{np.median([p['plain'] for p in priced]):.1f}" if priced else "-"
        best = f"{np.median([p['best'] for p in priced]):.1f}" if priced else "-"
        own = [p for p in priced if "tokens" in p]
        choice = (
            f"{np.median([p['tokens'] for p in own]):.2f} / {1e3 * np.median([p['seconds'] for p in own]):.0f}"
            if own
            else "-"
        )
        per_step = f"{tokens / len(paired):.2f}" if paired else "-"
        rate = f"{tokens / paired_seconds:.1f}" if paired else "-"
        timed = "".join(f" {1e3 * np.median([e['timers'].get(s, 0.0) for e in es]):.0f} |" for s in sections)
        lines.append(
            f"| {batch} | {kind} | {len(es)} | {seconds / total:.1%} | "
            f"{1e3 * np.median([e['seconds'] for e in es]):.0f} | {per_step} | {rate} | {plain} | {best} | {choice} |"
            + timed
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    args = ap.parse_args()
    engines = defaultdict(list)  # several engines may have appended to one trace
    for line in open(args.trace):
        record = json.loads(line)
        engines[record.get("pid")].append(record)
    entries = []
    for records in engines.values():
        records.sort(key=lambda r: r["t"])
        entries += steps(records)
    trials = sum(records[-1]["trials"] for records in engines.values())
    print(f"{len(engines)} engine(s), {sum(map(len, engines.values()))} decisions, {trials} trials")
    print("\n".join(summarise(entries)))


if __name__ == "__main__":
    main()
