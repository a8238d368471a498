"""``flowalign sample --out FILE`` checks the file again when it writes: a file that appeared at ``--out``
while the model sampled (another process's) is refused in one line and kept, not replaced unasked."""

import flowalign.sampling
from flowalign.cli.main import main


def _appearing(real, path, data):
    """``rollout`` that, while it samples, lets another process write ``data`` to ``path``."""

    def rollout(*args, **kwargs):
        result = real(*args, **kwargs)
        path.write_bytes(data)
        return result

    return rollout


def test_a_file_that_appears_during_sampling_is_not_replaced(tmp_path, capsys, monkeypatch, tiny_sd3_dir):
    out = tmp_path / "sample.png"
    # the command imports rollout when it runs
    monkeypatch.setattr(flowalign.sampling, "rollout", _appearing(flowalign.sampling.rollout, out,
                                                                  b"another process's image"))
    argv = ["sample", "--model", str(tiny_sd3_dir), "--prompt", "p", "--steps", "2", "--out", str(out)]
    assert main(argv) == 2
    # the model's loading progress aside, one line names the flag and the fix
    err = [line for line in capsys.readouterr().err.splitlines() if "already exists" in line]
    assert len(err) == 1 and f"--out {out} already exists" in err[0] and "--overwrite" in err[0]
    assert out.read_bytes() == b"another process's image"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sample.png"]  # no temporary left beside it
    out.unlink()
    assert main([*argv, "--overwrite"]) == 0  # asked: replaced
    assert out.read_bytes() != b"another process's image" and out.read_bytes()[:4] == b"\x89PNG"
