"""The package version, in a module of its own so that any module can read it without importing the
package's ``__init__`` (which lazily re-exports modules that would then import it back).

Example:
    >>> from llm_calib.version import __version__
    >>> __version__.count(".")
    2
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
