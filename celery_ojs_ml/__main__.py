"""`python -m celery_ojs_ml` runs the command line."""

from celery_ojs_ml.cli.main import main

if __name__ == "__main__":
    main()
