"""scripts/qm_ablation.py's tables: the cross-source (``shift``) ratios from synthetic rows."""
import importlib.util
import json
import math
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("qm_ablation", ROOT / "scripts" / "qm_ablation.py")
qm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(qm)


def _row(calib, factors, seed, gen, caldocs, damp_out=0.1):
    return {"calib": calib, "factors": factors, "incoherence": seed, "bits": 3,
            "labels": "sample", "shrink_out": 0 if factors == "global" else "auto",
            "damp_out": damp_out, "out_estimator": "crossfit" if factors == "global" else "mean",
            "host": "h", "tokens": 16384, "seqs": 128,
            "gen_kl_per_text": gen, "caldocs_kl_per_text": caldocs}


def test_shift_pairs_each_source_with_the_other_and_pools_seeds(tmp_path, capsys):
    rng = np.random.default_rng(0)
    rows, want = [], {}
    for calib, text in qm.SHIFT_FOLDS:
        a, b = [], []
        for seed in (0, 1):
            one = {t: list(rng.uniform(0.5, 1.0, 4)) for t in ("gen", "caldocs")}
            two = {t: [0.8 * x for x in one[t]] for t in one}
            two[text] = [x * f for x, f in zip(one[text], (0.6, 0.7, 0.9, 1.0))]
            rows += [_row(calib, "input", seed, one["gen"], one["caldocs"]),
                     _row(calib, "global", seed, two["gen"], two["caldocs"])]
            a += two[text]
            b += one[text]
        want[calib] = np.mean(a) / np.mean(b)
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows))
    qm.main(["shift", str(path)])
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| damp 0.1")]
    assert len(line) == 1
    cells = [c.strip() for c in line[0].strip("|").split("|")]
    assert cells[1] == "3" and cells[2] == "0, 1"
    got = [float(cells[3].split()[0]), float(cells[4].split()[0])]
    np.testing.assert_allclose(got, [want["generated"], want["builtin"]], atol=5e-4)
    assert abs(float(cells[5]) - math.sqrt(want["generated"] * want["builtin"])) < 1e-3
    assert cells[6].startswith("0.800") and cells[7].startswith("0.800")   # same source


def test_pool_shows_every_text_all_runs_were_scored_on(tmp_path, capsys):
    """Texts of ``run --text`` or ``score`` (here ``novel``) get a column after the built-in
    ones when every paired run has them; one that a run lacks (``lee``) gets none."""
    rng = np.random.default_rng(1)
    rows, a, b = [], [], []
    for seed in (0, 1):
        one = {t: list(rng.uniform(0.5, 1.0, 5)) for t in ("gen", "novel")}
        two = {t: [0.9 * x for x in one[t]] for t in one}
        two["novel"] = [x * f for x, f in zip(one["novel"], (0.5, 0.7, 0.8, 0.9, 1.1))]
        for factors, kl in (("input", one), ("global", two)):
            r = {**_row("generated+docs", factors, seed, kl["gen"], kl["gen"]),
                 "format": "float", "tile": 16, "refine": 0, "damp": 0.01, "rule": None,
                 "novel_kl_per_text": kl["novel"]}
            r.update({f"{t}_kl": float(np.mean(v)) for t, v in kl.items()})
            r["caldocs_kl"] = r["gen_kl"]
            if seed == 0 and factors == "global":
                r["lee_kl_per_text"] = [0.1] * 5   # (only one run: no lee column)
            rows.append(r)
        a += two["novel"]
        b += one["novel"]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows))
    qm.main(["pool", str(path)])
    out = capsys.readouterr().out.splitlines()
    head = [c.strip() for c in out[0].strip("|").split("|")]
    assert "lee KL, input / global" not in head
    i = head.index("novel KL, input / global")
    assert head.index("gen KL, input / global") < head.index("caldocs KL, input / global") < i
    cells = [c.strip() for c in out[2].strip("|").split("|")]
    assert cells[5] == "0, 1"
    assert abs(float(cells[i + 1].split()[0].strip("*")) - np.mean(a) / np.mean(b)) < 5e-3
    assert cells[head.index("gen KL, input / global") + 1].startswith("**0.90**")


def test_pool_seed_se_takes_the_seeds_as_the_unit(tmp_path, capsys):
    """``--seed-se``: the ratio is the same, its standard error is that of the seeds' mean KLs
    (paired by seed), which a seed-wide shift moves and the window-level one hardly sees."""
    rng = np.random.default_rng(2)
    rows, A, B = [], [], []
    for seed, f in zip((0, 1, 2), (0.6, 0.8, 1.0)):
        one = list(rng.uniform(0.5, 1.0, 40))
        two = [f * x * g for x, g in zip(one, rng.uniform(0.98, 1.02, 40))]
        for factors, kl in (("input", one), ("global", two)):
            r = {**_row("generated+docs", factors, seed, kl, kl), "format": "float",
                 "tile": 16, "refine": 0, "damp": 0.01, "rule": None,
                 "gen_kl": float(np.mean(kl)), "caldocs_kl": float(np.mean(kl))}
            rows.append(r)
        A.append(np.mean(two))
        B.append(np.mean(one))
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows))
    cells = {}
    for flag in ([], ["--seed-se"]):
        qm.main(["pool", str(path), *flag])
        line = capsys.readouterr().out.splitlines()[2]
        cells[bool(flag)] = [c.strip() for c in line.strip("|").split("|")][7]
    r, se = qm.ratio(A, B)
    assert se > 0.05
    assert cells[True].startswith(f"**{r:.2f}** ± {se:.2f} ")
    assert cells[False].split(" ±")[0] == cells[True].split(" ±")[0]
    assert float(cells[False].split("± ")[1].split()[0]) < se / 2
