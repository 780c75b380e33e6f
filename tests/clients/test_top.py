"""`chatpipe top` with no stack running. On the real stack, in a real terminal (tmux), it is tested in
tests/infra/test_stack_full.py, which starts the whole stack once for `up`, `status`, `top` and `down`."""

from __future__ import annotations

from tests.infra.test_stack_full import _cli


def test_top_without_a_stack_says_so_in_one_line(tmp_path):
    """Guards against a traceback or an empty screen when nothing runs in the state folder."""
    result = _cli("top", "--once", "--state-dir", str(tmp_path / "nothing"), timeout=60)
    assert result.returncode == 1
    assert "no stack runs in" in result.stderr and "chatpipe up" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
