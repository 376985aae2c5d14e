"""`--config FILE` (YAML or JSON, flag names with dashes or underscores, as vLLM's): the file
says what the flags would, and a flag on the command line wins."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchinfer.cli.config_file import expand_config
from batchinfer.cli.main import build_parser, main


def printed_config(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["serve", *argv, "--print-config"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_yaml_file_gives_the_same_engine_config_as_its_flags(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("max-num-seqs: 12\nmax_num_batched_tokens: 1024\n"
                    "enable-prefix-caching: false\nbatching: dynamic\nmax_batch_delay_ms: 2.5\n"
                    "preset: interactive\n")
    from_file = printed_config(capsys, "--config", str(path))
    from_flags = printed_config(capsys, "--max-num-seqs", "12", "--max-num-batched-tokens",
                                "1024", "--no-enable-prefix-caching", "--batching", "dynamic",
                                "--max-batch-delay-ms", "2.5", "--preset", "interactive")
    assert from_file == from_flags
    assert from_file["max_num_seqs"] == 12 and from_file["enable_prefix_caching"] is False
    # The command line wins over the file, wherever it stands.
    assert printed_config(capsys, "--max-num-seqs", "20", "--config", str(path))[
        "max_num_seqs"] == 20


def test_json_lists_and_booleans_become_flags(tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"goodput": ["ttft:500", "tpot:100"], "no_plots": True,
                                "num-prompts": 8}))
    parser = build_parser()
    argv = expand_config(parser, ["bench", "serve", "--config", str(path), "--seed", "3"])
    args = parser.parse_args(argv)
    assert args.goodput == ["ttft:500", "tpot:100"]
    assert args.num_prompts == 8 and args.seed == 3
    assert args.plots is False  # `no_plots: true` is the switch --no-plots


def test_the_command_line_wins_and_odd_values_pass(tmp_path: Path) -> None:
    path = tmp_path / "gen.yaml"
    path.write_text('stop: ["--end", "###"]\nmax-tokens: 5\n')
    parser = build_parser()
    args = parser.parse_args(expand_config(parser, ["generate", "--conf", str(path)]))
    assert args.stop == ["--end", "###"] and args.max_tokens == 5
    args = parser.parse_args(expand_config(parser, ["generate", "--config", str(path),
                                                    "--stop", "x", "--max-tokens=9"]))
    assert args.stop == ["x"] and args.max_tokens == 9  # the file's values gave way


@pytest.mark.parametrize(("text", "message"), [
    ("bogus-knob: 1\n", "unknown key 'bogus-knob'"),
    ("enable-prefix-caching: maybe\n", "must be true or false"),
    ("max-num-seqs: [1, 2]\n", "takes one value"),
    ("- a list\n", "must hold a mapping"),
    ("key: [unclosed\n", "not valid YAML"),
])
def test_a_bad_file_names_what_is_wrong(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        text: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--config", str(path), "--print-config"])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
