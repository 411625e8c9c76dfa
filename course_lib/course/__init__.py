"""The course as a whole: its notebooks executed end to end, outside the rank runtime (course_lib.launch).

runner     executes notebooks with papermill (`python -m course_lib.course.runner`): one table, NPROC per notebook
probe      a notebook's first cells alone in a kernel: which NPROC it accepts
kernel     the runner's kernel: sockets in a short private directory, why it died
preflight  before class: can this machine run the course (launch/check_node.sh); node: what it has
"""
