from pallets_sphinx_themes import get_version

# Project --------------------------------------------------------------

project = "flask-idem"
copyright = "flask-idem contributors"
author = "flask-idem contributors"
release, version = get_version("flask-idem")

# General --------------------------------------------------------------

extensions = [
    "sphinx.ext.autodoc",
    "pallets_sphinx_themes",
    "sphinx_click",
]
# No intersphinx: the build runs with -W and must pass offline, where an unreachable inventory is a
# warning. References to Python, Flask, Werkzeug and psycopg render as plain names instead of links.
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented_params"
autodoc_preserve_defaults = True
exclude_patterns = ["_build"]

# HTML -----------------------------------------------------------------

html_theme = "flask"
html_theme_options = {"index_sidebar_logo": False}
html_sidebars = {
    "index": ["localtoc.html", "searchbox.html"],
    "**": ["localtoc.html", "relations.html", "searchbox.html"],
}
singlehtml_sidebars = {"index": ["localtoc.html"]}
html_title = f"flask-idem Documentation ({version})"
html_show_sourcelink = False
