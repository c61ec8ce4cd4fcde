"""Every ``dgt`` command refuses a value it cannot run with its usage error (exit status 2, the option named), before
anything starts: not a traceback from inside a run, and not a run whose processes each fail in turn (as
``experiment ddp --batch 0`` did: every arm started and failed)."""

from __future__ import annotations

import argparse

import pytest
import torch

from dgt.cli import main
from dgt.cliargs import BadOption, integer, number

BAD = [
    # (argv, a fragment the error must contain)
    ("demo --queue-limit 0", "queue_limit"),
    ("demo --lr -1", "lr must be positive"),
    ("demo --momentum -1", "momentum"),
    ("demo --seed -1", "seed"),
    ("demo --deadline abc", "deadline policy 'abc'"),
    ("demo --dgt-codec bogus", "unknown codec 'bogus'"),
    ("demo --cross-dscp 99", "cross_dscp"),
    ("experiment ddp --workers 0", "at least 2 workers"),
    ("experiment ddp --max-time -1", "max_time"),
    ("experiment ddp --target 5", "target accuracy"),
    ("experiment ddp --batch 0", "batch"),
    ("experiment ddp --lr -1", "lr"),
    ("experiment ddp --rate abc", "bad rate 'abc'"),
    ("experiment ddp --queue-limit 0", "queue-limit"),
    ("experiment ddp --arms gloo,nonsense", "unknown arms"),
    ("experiment codecs --workers 0", "workers"),
    ("experiment codecs --rate x", "bad rate 'x'"),
    ("experiment codecs --deadline x", "deadline policy 'x'"),
    ("experiment codecs --lr 0", "--lr"),
    ("bench ddp --world 0", "--world"),
    ("bench ddp --steps 0", "--steps"),
    ("bench ddp --threads 0", "--threads"),
    ("bench ddp --drop 1", "--drop"),
    ("bench ddp --model foo", "unknown model 'foo'"),
    ("bench ddp --modes fp16", "--modes must start with gloo"),
    ("bench ddp --lossy-codec bogus", "--lossy-codec"),
    ("bench allreduce --ranks 1", "--ranks"),
    ("bench allreduce --mb -1", "--mb"),
    ("bench allreduce --mb nan", "--mb"),
    ("bench allreduce --codec bogus", "--codec 'bogus'"),
    ("bench allreduce --collectives foo", "--collectives"),
    ("bench allreduce --hop-threads 3", "--hop-threads"),
    ("bench allreduce --cpu-gate 1.5", "--cpu-gate"),
    ("bench codec --numel 0", "--numel"),
    ("bench codec --numel 3 --tensors 4", "--tensors"),
    ("bench codec --p 2", "--p"),
    ("bench codecs --numel -5", "--numel"),
    ("bench codecs --device tpu", "--device"),
    ("bench codecs --codec qsgd:bogus=1", "--codec 'qsgd:bogus=1'"),
    ("bench hop --rounds 0", "--rounds"),
    ("bench hop --p -1", "--p"),
    ("bench hop --batch 0", "--batch"),
    ("bench inspect --block 0", "--block"),
    ("bench lgc --ranks 0", "--ranks"),
    ("bench lgc --iters 400", "--iters"),
    ("bench lgc --device tpu", "--device"),
    ("bench lgc --lgc bogus=1", "unknown lgc option"),
    ("bench transport --mb 0", "--mb"),
    ("bench transport --repeats 0", "--repeats"),
    ("bench transport --p 5", "--p"),
    ("bench transport --variants foo", "--variants"),
    ("bench transport --datagram-payload 0", "--datagram-payload"),
    ("capture --count 0", "--count"),  # scapy's count=0 is "no limit": a capture that never ends by itself
    ("capture --duration -1", "--duration"),
    ("inspect x.pcap --rounds -1", "--rounds"),
    ("inspect x.pcap --tcp-port 70000", "--tcp-port"),
]
if not torch.cuda.is_available():  # with a device this is a valid run, not an error
    BAD += [("bench codecs --device cuda", "no CUDA device"), ("bench lgc --device cuda", "no CUDA device")]


@pytest.mark.parametrize(("argv", "fragment"), BAD, ids=[a for a, _ in BAD])
def test_a_value_the_command_cannot_run_is_its_usage_error(argv: str, fragment: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv.split())
    err = capsys.readouterr().err
    words = argv.split()
    command = " ".join(words[:2] if words[0] in ("experiment", "bench", "netem") else words[:1])
    assert exc.value.code == 2, err
    assert "error:" in err and fragment in err, err
    assert "Traceback" not in err
    assert err.splitlines()[0].startswith(f"usage: dgt {command} "), err  # the command's own usage, not dgt's


def test_integer_and_number_types_name_the_range() -> None:
    assert integer(1)("3") == 3 and integer(-1, 5)("-1") == -1
    for parse, text, message in [(integer(1), "0", r"outside \[1, inf\)"), (integer(1), "x", "not an integer"),
                                 (integer(16, 65000), "65001", r"outside \[16, 65000\]"),
                                 (number(0.0, above=True), "0", r"outside \(0, inf\)"),
                                 (number(0.0, 1.0, below=True), "1", r"outside \[0, 1\)"),
                                 (number(0.0), "inf", "outside"), (number(), "nan", "outside"),
                                 (number(), "abc", "not a number")]:
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            parse(text)
    assert number(0.0, 1.0, below=True)("0") == 0.0 and number(0.0, above=True)("1e-9") == 1e-9


def test_bad_option_is_a_dgt_error() -> None:
    from dgt.errors import DgtError

    assert issubclass(BadOption, DgtError)  # a library caller catching DgtError catches it too
