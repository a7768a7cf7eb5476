"""The README's main job: ``mini-paged-attn demo`` on CPU."""

from mini_paged_attn.cli import main


def test_demo_runs_and_paged_attention_matches_dense(capsys):
    assert main(["demo", "--seed", "1"]) == 0
    text = capsys.readouterr().out
    assert "(OK)" in text
    assert "copy-on-write" in text
    # Both parts end with the whole pool free again.
    assert "0 used (0 shared), 16 free" in text
    assert "after the run: 96/96 blocks free" in text
    # The n=2 request produced two samples.
    assert "n2[0]" in text and "n2[1]" in text
