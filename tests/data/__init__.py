"""Tests of blocktrain.data (a package so its test module names cannot clash with other folders')."""
