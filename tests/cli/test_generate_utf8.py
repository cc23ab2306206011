"""`blocktrain generate --utf8`: a barely trained run writes invalid UTF-8 (U+FFFD once
decoded) without the option, and text that decodes strictly with it."""

from __future__ import annotations

from blocktrain.cli.main import main


def generated(capsys, run, *extra: str) -> str:
    argv = [
        "generate",
        str(run),
        "--prompt",
        "Señor ",
        "--bytes",
        "60",
        "--set",
        "continuation_only=1",
    ]
    assert main([*argv, "--seed", "2", *extra]) == 0
    return capsys.readouterr().out.removesuffix("\n")


def test_generate_utf8_keeps_the_output_valid(capsys, trained):
    free = generated(capsys, trained)
    assert "\ufffd" in free, "without --utf8 the 2-step run writes invalid bytes"
    kept = generated(capsys, trained, "--utf8")
    assert "\ufffd" not in kept
    data = kept.encode("utf-8")
    assert data.decode("utf-8") == kept and 57 <= len(data) <= 60, len(data)
    assert generated(capsys, trained, "--utf8") == kept, "the seed repeats it"
