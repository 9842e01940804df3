"""The configs live at the repository's top (`conf/`, `recipes/`); a built wheel carries them inside the package
(`specgen/conf/`, `specgen/conf/recipes/`), where specgen.config looks first. Everything else is in pyproject.toml."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithConfigs(build_py):
    def run(self):
        super().run()
        if not self.editable_mode:  # an editable install reads the checkout's own conf/ and recipes/
            conf = os.path.join(self.build_lib, "specgen", "conf")
            self.copy_tree("conf", conf)
            self.copy_tree("recipes", os.path.join(conf, "recipes"))


setup(cmdclass={"build_py": BuildPyWithConfigs})
