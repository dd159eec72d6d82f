"""tools/gpu_costs.py is run where a GPU is lent, with no time to debug it there: its whole path
(model, document-masked attention, timing, the fit, msd's layout against arrival order) runs here
on the CPU, small."""

import json
import subprocess
import sys


def test_the_gpu_script_runs_its_whole_path_on_a_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    r = subprocess.run([sys.executable, "tools/gpu_costs.py", "--device", "cpu", "--tiny", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    fit = result["fit"]
    assert fit["samples"] == 24 and len(fit["measured"]) == 24
    assert all(s > 0 for *_, s in fit["measured"])
    assert fit["coefficients"]["quadratic"] >= 0 and fit["fit_error"] < 1
    layouts = result["layouts"]
    assert len(layouts["steps"]) == 2
    for step in layouts["steps"]:
        assert step["tokens"] <= 8 * 2 * 512 and step["msd"]["step_s"] > 0 and step["arrival_order"]["step_s"] > 0
        for layout in ("msd", "arrival_order"):
            assert step[layout]["max_over_mean"] >= 1 and step[layout]["predicted_max_over_mean"] >= 1
    assert layouts["gain"] == 1 - sum(s["msd"]["step_s"] for s in layouts["steps"]) / sum(
        s["arrival_order"]["step_s"] for s in layouts["steps"])
