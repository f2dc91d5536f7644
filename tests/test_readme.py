"""Every Python code block of the README runs, in order, in one namespace."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_readme_has_code():
    assert len(python_blocks()) >= 2


def test_readme_python_blocks_run(capsys):
    namespace: dict = {}
    for block in python_blocks():
        exec(compile(block, str(README), "exec"), namespace)
    printed = capsys.readouterr().out
    assert "Partitioned(f32[256,512], names=('data', 'model'))" in printed
    assert "{'emb': P('data', 'model'), 'out': P('model', 'data')}" in printed
    assert "LogicallyPartitioned(f32[3,16,32], names=('layers', 'embed', 'mlp'))" in printed
    assert "P('model', None)" in printed  # the tour on the default, Explicit mesh ran
    assert "P(None, 'data', 'model') P(None, 'data')" in printed  # restored onto 4x2
    assert "(256, 3584) 1835008 True\n7340036\n" in printed  # planning at scale
    assert "{'attn': {'b': P(), 'w': P(None, 'tensor')}, 'wte': P(None, 'fsdp')}" in printed
    assert printed.count("P('data', 'model')\n") >= 1  # flax params, converted and sharded
    assert "P('model', 'data')\n" in printed  # an equinox layer, sharded


def test_readme_api_table_lists_every_public_name():
    import spmdtree

    table = README.read_text().split("## API", 1)[1].split("\n## ", 1)[0]
    missing = [name for name in spmdtree.__all__ if f"`{name}" not in table]
    assert missing == []
