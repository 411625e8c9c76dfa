"""The course's tooling that no notebook imports (run from the repository root as `python -m tools.<module>`).

editions   the learner's copies and the site's sources from notebooks/
runner     executes notebooks with papermill (`python -m tools.runner`): one table, NPROC per notebook
probe      a notebook's first cells alone in a kernel: which NPROC it accepts
kernel     the runner's kernel: sockets in a short private directory, why it died
preflight  before class: can this machine run the course (launch/check_node.sh); node: what it has
"""
