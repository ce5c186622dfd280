def test_cache():
    assert True
