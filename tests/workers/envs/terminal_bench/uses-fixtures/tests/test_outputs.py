def test_out(tmp_path):
    assert (tmp_path / "x").exists() is False
