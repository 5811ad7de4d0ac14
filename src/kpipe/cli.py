"""The one ``kpipe`` command. Subcommands live next to the library code they call and are
imported only when used, so ``kpipe query`` never pays for importing torch."""

from __future__ import annotations

import importlib
import importlib.util

import click

# name -> "module:attribute" of a click command or group
SUBCOMMANDS = {
    "query": "kpipe.data.db:query_command",
    "data": "kpipe.data.cli:data",
    "gym": "kpipe.gym.cli:gym",
    "serve": "kpipe.llm.cli:serve",
    "llm": "kpipe.llm.cli:llm",
    "agent": "kpipe.agent.cli:agent",
    "train": "kpipe.train.cli:train",
    "metrics": "kpipe.data.metrics_cli:metrics",
    "gpu": "kpipe.infra.gpu:gpu_command",
    "eval": "kpipe.evaluate.cli:eval_cli",
    "tables": "kpipe.report.cli:tables",
    "plan": "kpipe.report.cost_cli:plan",
    "launch": "kpipe.infra.launch:launch",
    "view": "kpipe.report.viewer:view_command",
    "outdated": "kpipe.infra.outdated:outdated_command",
}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(name for name in SUBCOMMANDS if self._spec_importable(name))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        spec = SUBCOMMANDS.get(name)
        if spec is None:
            return None
        module, attribute = spec.split(":")
        return getattr(importlib.import_module(module), attribute)

    @staticmethod
    def _spec_importable(name: str) -> bool:
        module = SUBCOMMANDS[name].split(":")[0]
        return importlib.util.find_spec(module) is not None


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kpipe")
def main() -> None:
    """kpipe: reproduce Dr. Kernel's RL of Triton kernel generation, with KernelGym."""


if __name__ == "__main__":
    main()
