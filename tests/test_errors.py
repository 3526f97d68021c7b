"""The one line of an error that a message quotes (``errors.first_line``)."""

from hvd_train.errors import first_line


def test_the_first_line_of_an_error_without_tensorflows_decorations_or_a_urls_password():
    op = ValueError("{{function_node __wrapped__SaveV2_dtypes_1}} No space left on device [Op:SaveV2]\nmore")
    assert first_line(op) == "No space left on device"
    assert first_line("Invalid PNG data, size 10 [[{{node DecodePng}}]]") == "Invalid PNG data, size 10"
    assert first_line(OSError("Could not connect to http://user:secret@127.0.0.1:9000/b")) == (
        "Could not connect to http://127.0.0.1:9000/b"
    )
    assert first_line(ImportError("no module named x"), named=True) == "ImportError: no module named x"
    assert first_line(KeyError()) == "KeyError" and first_line("") == ""
    assert first_line(RuntimeError("x" * 500), limit=200) == "x" * 200
