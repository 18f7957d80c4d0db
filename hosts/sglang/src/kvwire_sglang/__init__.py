"""kvwire inside a stock sglang, selected through sglang's own plugin framework (see :mod:`kvwire_sglang.plugin`)."""
