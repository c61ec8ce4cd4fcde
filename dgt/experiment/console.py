"""What the user sees in the terminal: a rich progress bar per run and the Table 1 comparison."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table

PAPER: dict[str, dict[str, dict[str, float]]] = {
    # Table 1 of the paper (6 GPUs, 1 Gbps, Fashion-MNIST, target accuracy 0.8)
    "alexnet": {"baseline": {"bct": 36.72, "iters": 1300, "time": 47494},
                "dgt": {"bct": 23.71, "iters": 1700, "time": 40314}},
    "vgg11": {"baseline": {"bct": 105.34, "iters": 420, "time": 44246},
              "dgt": {"bct": 73.75, "iters": 490, "time": 36141}},
}
MODEL_NAMES = {"alexnet": "AlexNet", "vgg11": "VGG-11"}


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def unimportant_cell(s: dict[str, Any], counts: bool = False) -> str:
    """The unimportant blocks of a run summary: delivered / lost / held back (never sent: the send budget kept them
    back), as shares of them all (``counts``: the block counts too); ``-`` for a run without any (the baseline)."""
    u = s.get("unimportant_blocks")
    if not u or not u["total"]:
        return "-"
    shares = "/".join(f"{100 * u[k + '_share']:.1f}" for k in ("delivered", "lost", "held_back")) + "%"
    if not counts:
        return shares
    return f"{u['delivered']:,} / {u['lost']:,} / {u['held_back']:,} of {u['total']:,} ({shares})"


def fmt_bytes(n: float) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n:.0f} B"


class Reporter:
    """Progress bars while runs train, then the results table. ``quiet`` prints nothing (tests)."""

    def __init__(self, console: Console | None = None, quiet: bool = False) -> None:
        self.console = console or Console()
        self.quiet = quiet
        self.progress: Progress | None = None
        self.task: Any = None

    def note(self, text: str) -> None:
        if not self.quiet:
            self.console.print(text)

    def start_run(self, model: str, protocol: str, max_iters: int) -> None:
        if self.quiet:
            return
        self.progress = Progress(
            TextColumn(f"[bold]{MODEL_NAMES.get(model, model)} {protocol:<8}"), BarColumn(bar_width=15),
            MofNCompleteColumn(),
            TextColumn("acc {task.fields[acc]}  BCT {task.fields[bct]}  p {task.fields[p]}  {task.fields[train]}"),
            console=self.console, transient=False,
        )
        self.progress.start()
        self.task = self.progress.add_task("run", total=max_iters, acc="-", bct="-", p="-", train="-")

    def update(self, rec: dict[str, Any]) -> None:
        if self.progress is None:
            return
        fields = {"bct": f"{rec['bct']:.2f}s", "p": f"{rec['p']:.2f}" if "p" in rec else "-",
                  "train": f"{rec['train_time']:.0f}s trained"}
        if "acc" in rec:
            fields["acc"] = f"{rec['acc']:.3f}"
        self.progress.update(self.task, completed=rec["it"], **fields)

    def end_run(self, summary: dict[str, Any] | None = None, error: str | None = None) -> None:
        if self.progress is not None:
            if summary is not None:
                self.progress.update(self.task, total=summary["iterations_run"], completed=summary["iterations_run"])
            self.progress.stop()
            self.progress = None
        if error and not self.quiet:
            self.console.print(f"[red]run failed:[/red] {error}")

    def table(self, results: dict[str, Any]) -> None:
        if not self.quiet:
            self.console.print(results_table(results))


def results_table(results: dict[str, Any]) -> Table:
    """The paper's Table 1 columns (BCT, total iterations, total time to the target accuracy) and what DGT changed,
    with the megabytes each lane carried and what became of the unimportant blocks: delivered, lost, or held back
    by the send budget and never sent (narrow enough for 80 columns)."""
    cfg = results["config"]
    t = Table(title=f"Time to test accuracy {cfg['target']:g}: {results['network']['mode']} network, "
                    f"{cfg['workers']} workers, {cfg['dataset']}",
              caption="Unimportant blocks: delivered / lost / held back (never sent: the send budget kept them "
                      "back; error feedback carries them)")
    for col in ("Model", "Protocol", "BCT s", "Iters", "Time s", "TCP/UDP MB", "Unimp. deliv/lost/held", "p"):
        t.add_column(col, justify="left" if col in ("Model", "Protocol") else "right")
    for model in cfg["models"]:
        for r in (r for r in results["runs"] if r["model"] == model):
            s = r.get("summary")
            if s is None:
                t.add_row(MODEL_NAMES.get(model, model), r["protocol"], "[red]failed", *[""] * 5)
                continue
            lanes = s["bytes_per_lane"]
            t.add_row(
                MODEL_NAMES.get(model, model), r["protocol"], f"{s['bct_mean']:.3f}", str(s["iterations"]),
                f"{s['time_to_target']:.1f}" if s["reached"] else f"[red]>{s['train_time']:.1f}",
                f"{lanes.get('0', 0) / 1e6:.0f}/{lanes.get('1', 0) / 1e6:.0f}", unimportant_cell(s),
                f"{s['p_mean']:.2f}",
            )
        cmp = results["comparisons"].get(model)
        if cmp:
            inc = "" if cmp["iteration_increase"] is None else f"{100 * cmp['iteration_increase']:+.0f}%"
            t.add_row("", "[bold]DGT change", f"[bold]{_signed(cmp['bct_reduction'])}", inc,
                      f"[bold]{_signed(cmp['time_reduction'])}", "", "", "", end_section=True)
    return t


def _signed(reduction: float | None) -> str:
    return "-" if reduction is None else f"{-100 * reduction:+.1f}%"
