"""Human-readable rendering of a summary (rich tables), so a glance shows lanes, markings, losses and warnings."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from dgt.inspect.summary import dscp_name


def _dscp(hist: dict[str, int]) -> str:
    return ", ".join(f"{dscp_name(int(k))}×{v}" for k, v in sorted(hist.items(), key=lambda kv: -kv[1])) or "-"


def _mb(n: int) -> str:
    return f"{n / 1e6:.3f}"


def render(summary: dict, console: Console | None = None, max_rounds: int = 20) -> None:
    """Print the overview, the per-lane table, the first ``max_rounds`` rounds, flows and warnings."""
    con = console or Console()
    if not con.is_terminal:
        con.width = max(con.width, 160)  # pipes and CI logs: do not squeeze the tables to 80 columns
    s = summary
    t = s["totals"]
    con.print(
        f"[bold]{s.get('file') or 'capture'}[/]: {s['packets']} packets, {s['dgt_packets']} DGT, "
        f"{s['duration_s']:.3f} s; {t['rounds']} rounds ({t['rounds_closed']} closed by a drop report), "
        f"{len(s['sessions'])} session(s)"
    )
    con.print(_lanes_table(s["lanes"]))
    con.print(
        f"blocks {t['blocks']}: important {t['important']}, unimportant received {t['unimportant_received']}, "
        f"dropped {t['dropped']} (partial {t['partial']}, missing {t['missing']}), "
        f"unsent {t.get('unsent', 0)} (kept back by the send budget), late frames {t['late_frames']}, "
        + (
            f"not placed on a lane (no fragment seen, several unreliable lanes): lost {t['lost_unplaced']}, unsent "
            f"{t['unsent_unplaced']}, "
            if t.get("lost_unplaced") or t.get("unsent_unplaced")
            else ""
        )
        + f"duplicated {t['duplicated']}, reordered {t['reordered']}, rejected {t['rejected']}"
    )
    if t.get("bulk_messages"):
        con.print(
            f"bulk messages (lossless, no round state) {t['bulk_messages']}: {t['bulk_complete']} complete, "
            f"{_mb(t['bulk_bytes'])} MB"
        )
    if s["rounds"]:
        con.print(_rounds_table(s["rounds"], max_rounds))
    if s["flows"]:
        con.print(_flows_table(s["flows"]))
    m = s["malformed"]
    if m["total"]:
        con.print(f"[yellow]malformed: {m['total']}[/] " + ", ".join(f"{k}={v}" for k, v in m["reasons"].items()))
    for w in s["warnings"]:
        con.print(f"[bold yellow]warning:[/] {w}")


def _lanes_table(lanes_of: dict[str, dict]) -> Table:
    lanes = Table(title="lanes", title_justify="left")
    for c in (
        "lane",
        "proto",
        "packets",
        "wire MB",
        "frames",
        "blocks",
        "data MB",
        "goodput MB",
        "lost",
        "unsent",
        "dup",
        "reord",
        "late",
        "rejected",
        "DSCP seen",
        "expected",
    ):
        lanes.add_column(c, justify="right" if c not in ("proto", "DSCP seen", "expected") else "left")
    for lane, v in lanes_of.items():
        ok = "" if v["dscp_ok"] else "[red]"
        lanes.add_row(
            lane,
            v["transport"],
            str(v["packets"]),
            _mb(v["wire_bytes"]),
            str(v["frames"]),
            str(v["blocks"]),
            _mb(v["bytes"]),
            _mb(v["goodput_bytes"]),
            str(v.get("lost_blocks", 0)),
            str(v.get("unsent_blocks", 0)),
            str(v["duplicated"]),
            str(v["reordered"]),
            str(v["late_frames"]),
            str(v["rejected"]),
            ok + _dscp(v["dscp"]),
            "/".join(dscp_name(x) for x in v["expected_dscp"]),
        )
    return lanes


def _rounds_table(rounds: list[dict], max_rounds: int) -> Table:
    rt = Table(
        title=f"rounds (first {min(max_rounds, len(rounds))} of {len(rounds)})", title_justify="left"
    )
    for c in (
        "sender",
        "bucket",
        "round",
        "t_begin",
        "dur ms",
        "blocks",
        "imp",
        "unimp",
        "dropped",
        "unsent",
        "partial",
        "late",
        "dup",
        "reord",
        "report",
    ):
        rt.add_column(c, justify="right")
    for r in rounds[:max_rounds]:
        rep = r["report"]
        rep_s = "-" if rep is None else ("bad" if not rep["valid"] else ("ok" if rep["agrees"] else "[red]differs"))
        rt.add_row(
            str(r["sender"]),
            str(r["bucket"]),
            str(r["round"]),
            f"{r['t_begin']:.4f}",
            f"{r['duration'] * 1e3:.2f}",
            str(r["blocks"]),
            str(r["important"]),
            str(r["unimportant_received"]),
            str(r["dropped"]),
            str(r.get("unsent", 0)),
            str(r["partial"]),
            str(r["late_frames"]),
            str(r["duplicated"]),
            str(r["reordered"]),
            rep_s,
        )
    return rt


def _flows_table(flows: list[dict]) -> Table:
    ft = Table(title="DGT flows", title_justify="left")
    for c in ("proto", "src", "dst", "packets", "wire MB", "DSCP", "found by"):
        ft.add_column(c)
    for f in flows:
        ft.add_row(
            f["proto"],
            f"{f['src']}:{f['sport']}",
            f"{f['dst']}:{f['dport']}",
            str(f["packets"]),
            _mb(f["wire_bytes"]),
            _dscp(f["dscp"]),
            f["detected_by"],
        )
    return ft
