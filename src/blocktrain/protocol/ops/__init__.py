"""The protocol's operations: whole runs on one machine, and their reports.

    cluster  an aggregator and N worker processes on this machine, over real HTTP
    report   a run's history drawn as PNG plots and one HTML page

May import every room of protocol/ (tests/test_layers.py).
"""
