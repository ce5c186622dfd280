def test_inverse():
    assert True
