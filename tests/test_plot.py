"""nanokl/harness/plot.py: the curve it draws, and a picture from a tiny run directory (matplotlib extra)."""

import json

import pytest

from nanokl.harness.plot import curve


def test_curve_takes_the_steps_that_have_a_number():
    rows = [{"training/global_step": 0, "v": 1.0}, {"training/global_step": 1}, {"training/global_step": 2, "v": 3},
            {"training/global_step": 3, "v": "warn"}]
    assert curve(rows, "v") == ([0, 2], [1.0, 3])


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from nanokl.harness.plot import plot_run
    rows = [{"training/global_step": s, "actor/reward_kl_penalty": 0.01 * s, "actor/reward_kl_penalty_coeff": 0.05,
             "critic/score/mean": 0.1 * s, "critic/rule_score/mean": 0.05 * s, "actor/entropy": 1.0,
             "val-core/arith/acc/mean@1": 0.1 * s} for s in range(4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "config.yaml").write_text("trainer:\n  kl_monitor: {enable: true, kl_low: 0.02, kl_high: 0.08}\n")
    out = plot_run(tmp_path)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_monitor_events_are_the_checks_that_fired_with_their_action():
    from nanokl.harness.plot import monitor_events
    rows = [{"training/global_step": 1, "monitor/kl_band_fired": 0.0},
            {"training/global_step": 2, "monitor/action/kl_band": 1.0, "monitor/action/kl_critical": 4.0},
            {"training/global_step": 3},
            {"training/global_step": 4, "monitor/action/entropy": 2.0}]
    assert monitor_events(rows) == [(2, "kl_band", "warn"), (2, "kl_critical", "stop"), (4, "entropy", "adjust")]


def test_a_mark_is_a_dashed_line_at_its_step_on_every_panel(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.figure
    from nanokl.harness import plot
    rows = [{"training/global_step": s, "actor/reward_kl_penalty": 0.01 * s, "monitor/action/kl_band": 1.0}
            for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen = {}
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, out, **kw: seen.setdefault("fig", fig))
    plot.main([str(tmp_path), "--mark", "4:damage"])
    axes = seen["fig"].axes
    dashed = [[ln for ln in ax.get_lines() if ln.get_linestyle() == "--" and list(ln.get_xdata()) == [4, 4]]
              for ax in axes]
    assert len(axes) == 7 and all(len(d) == 1 for d in dashed)
    assert "damage" in [t.get_text() for t in axes[0].texts]
    with pytest.raises(plot.UserError, match="--mark x:damage"):
        plot.main([str(tmp_path), "--mark", "x:damage"])
