"""Alembic's env.py of an application that uses flask-idem without Flask-SQLAlchemy (docs/upgrades.rst)."""

from logging.config import fileConfig

from alembic import context
from quickstart import create_app

from flask_idem import alembic as idem_alembic

if context.config.config_file_name is not None:
    fileConfig(context.config.config_file_name)

# Inside the application's context, run_migrations() connects to its IDEM_DATABASE_URL and upgrades
# the key table its IDEM_TABLE names. Without a Flask application: run_migrations(url=os.environ[...]).
with create_app().app_context():
    idem_alembic.run_migrations()
