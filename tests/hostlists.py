"""Slurm node lists and their hosts, as Slurm 22.05's `scontrol show hostnames` prints them: the
expected values of hvdtrain.launch.slurm.expand_hostlist (tests/test_launch.py), checked against
scontrol itself on the local Slurm (tests/test_slurm.py)."""

HOSTLISTS = {
    "node[1-3,7]": ["node1", "node2", "node3", "node7"],
    "gpu[01-02],cpu[1-3]": ["gpu01", "gpu02", "cpu1", "cpu2", "cpu3"],
    "n[8-10]": ["n8", "n9", "n10"],
    "n[08-10]": ["n08", "n09", "n10"],
    "n[008-10]": ["n008", "n009", "n010"],
    "n[098-101]": ["n098", "n099", "n100", "n101"],
    # Each range is padded to the width of its first number.
    "n[1-010]": [f"n{i}" for i in range(1, 11)],
    "n[01-02,5]": ["n01", "n02", "n5"],
    "n[00-2]": ["n00", "n01", "n02"],
    "n[0-0]": ["n0"],
    # Order and repeats are kept.
    "node3,node1": ["node3", "node1"],
    "n[5,1-2]": ["n5", "n1", "n2"],
    "n1,n1": ["n1", "n1"],
    # Several brackets: every combination, the first bracket slowest.
    "rack[1-2]-n[01-02]": ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"],
    "x[1-3]y[5,7]": ["x1y5", "x1y7", "x2y5", "x2y7", "x3y5", "x3y7"],
    "n[1-2]-[3-4]": ["n1-3", "n1-4", "n2-3", "n2-4"],
    "foo": ["foo"],
    "n.example.com": ["n.example.com"],
    "[1-2]": ["1", "2"],
    # Whitespace separates too; empty items are nothing.
    "n[1-2] m[3]": ["n1", "n2", "m3"],
    "n[1-2],,": ["n1", "n2"],
}

# Lists Slurm refuses ("Invalid hostlist", or garbage for an unclosed bracket).
BAD_HOSTLISTS = ["n[3-1]", "n[]", "n[a-b]", "n[1-2", "n[1-2]]"]
