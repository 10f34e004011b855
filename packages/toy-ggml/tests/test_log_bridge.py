"""ggml's own log output reaches Python logging (logger ``toy_ggml``)."""

import logging

import toy_ggml as tg


def test_ggml_log_goes_to_python_logging(caplog):
    with tg.Context() as ctx:
        a = ctx.tensor(tg.GGMLType.F32, (2, 3), name="a")
        b = ctx.exp(a)
        g = tg.Graph(ctx).build_forward(b)
        with caplog.at_level(logging.INFO, logger="toy_ggml"):
            g.log()  # ggml_graph_print -> GGML_LOG_INFO
    records = [r for r in caplog.records if r.name == "toy_ggml"]
    text = "\n".join(r.getMessage() for r in records)
    assert "=== GRAPH ===" in text
    assert "EXP" in text or "UNARY" in text
    assert all(r.levelno == logging.INFO for r in records)
    # lines are whole: the bridge joins ggml's partial writes at newlines
    assert all("\n" not in r.getMessage() for r in records)
