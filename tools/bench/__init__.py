"""The benchmark harness behind ``dyncompile bench``: one measurement discipline for every plan kind."""
