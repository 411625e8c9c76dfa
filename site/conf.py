"""Sphinx configuration of the course's site: the executed notebooks as a book, read without running anything.

`make site` copies this folder and the notebooks (answers folded) into build/site-src/ with tools/editions.py and
builds build/site/ from there. Nothing is executed and nothing is fetched: MathJax is served from _static/.
"""

project = "Distributed training with PyTorch"
author = "the course's authors"
copyright = "the course's authors, Apache-2.0"

extensions = ["myst_nb"]
exclude_patterns = ["_build", "**.ipynb_checkpoints"]
nb_execution_mode = "off"  # the stored outputs are the book; the notebooks run in `make course` and CI
nb_merge_streams = True  # a rank's output lines and the launcher's, in the order they were printed
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3  # "[section 2](#...)" links and the page's table of contents

html_theme = "sphinx_book_theme"
html_title = project
html_static_path = ["_static"]
html_css_files = ["course.css"]
html_theme_options = {
    "show_navbar_depth": 1,
    "show_toc_level": 2,
    "use_download_button": True,  # the page's .ipynb, to run in the course environment
    "home_page_in_toc": True,
}
html_last_updated_fmt = None
html_copy_source = True
mathjax_path = "mathjax/tex-svg.js"  # relative to _static: the site's own copy (tools/editions.py)
mathjax3_config = {"loader": {"paths": {"mathjax": "_static/mathjax"}}, "tex": {"autoload": {}}}
