"""flask-idem's revisions: one file per layout of its tables, oldest first.

Each file is at once the data ``flask idem migrate`` runs (its ``REVISION``, a
:class:`flask_idem._layout.Revision`) and an Alembic revision on the ``flask_idem`` branch, whose
``upgrade()`` runs the same statements through Alembic's connection (:mod:`flask_idem.alembic`). A
Flask-Migrate project finds them through Alembic's ``version_locations``. The files import nothing of
Alembic at module level, so that ``flask idem migrate`` needs no Alembic.

To change the layout, add one file here, ``v<N>_<what>.py``, with revision ``flask_idem_<N>`` (four digits)
whose ``down_revision`` is the one before. Never change a file once released.
"""
