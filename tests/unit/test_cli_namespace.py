"""Every command that takes a namespace reads it from TRAJPIPE_NS when --ns is not given."""
from __future__ import annotations

from typing import Callable

import pytest

NS = "from-env"


def parsed() -> dict[str, Callable[[], str]]:
    import consumers.archive
    import consumers.export
    import consumers.lineage
    import consumers.monitor
    import consumers.replay
    import consumers.shard_writer
    import infra.__main__
    import infra.demo
    import learner.eval
    import learner.settings
    import producers.settings
    import streams.settings

    return {
        "streams": lambda: streams.settings.StreamSettings.from_args([]).ns,
        "producers": lambda: producers.settings.from_args([]).ns,
        "learner": lambda: learner.settings.from_args([]).ns,
        "learner.eval": lambda: learner.eval.parser().parse_args([]).ns,
        "consumers.shard_writer": lambda: consumers.shard_writer.parse_args([]).ns,
        "consumers.monitor": lambda: consumers.monitor.parse_args([]).ns,
        "consumers.archive": lambda: consumers.archive.parse_args([]).ns,
        "consumers.export": lambda: consumers.export.parse_args(["--format", "sft", "--out", "x.jsonl"]).ns,
        "consumers.lineage": lambda: consumers.lineage.parse_args(["traj-1"]).ns,
        "consumers.replay": lambda: consumers.replay.parse_args(["--to-ns", "elsewhere"]).from_ns,
        "infra bootstrap": lambda: infra.__main__.parser().parse_args(["bootstrap"]).ns,
        "infra smoke": lambda: infra.__main__.parser().parse_args(["smoke"]).ns,
        "infra demo": lambda: infra.demo.parser().parse_args([]).ns,
    }


@pytest.mark.parametrize("command", sorted(parsed()))
def test_each_command_uses_trajpipe_ns(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAJPIPE_NS", NS)
    assert parsed()[command]() == NS


@pytest.mark.parametrize("command", ["consumers.shard_writer", "consumers.monitor", "infra bootstrap"])
def test_without_it_the_namespace_is_required(command: str, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("TRAJPIPE_NS", raising=False)
    with pytest.raises(SystemExit):
        parsed()[command]()
    assert "--ns" in capsys.readouterr().err
