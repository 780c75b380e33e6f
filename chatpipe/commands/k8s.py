"""``chatpipe k8s render | values | validate``: Kubernetes manifests from the project's settings and catalog.

``render`` writes one YAML file per component and a kustomization.yaml (``--out DIR``; without it, all to
stdout), ``values`` prints every value ``--values FILE`` may set with its default, ``validate`` runs
kubeconform in strict mode on a rendered folder against the vendored schemas (built once with Go).
The objects come from ``k8s/`` (docs/deploy.md "Kubernetes").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from chatpipe.commands.common import err_console, print_error

app = typer.Typer(help="Kubernetes manifests: render, values, validate (docs/deploy.md \"Kubernetes\").",
                  no_args_is_help=True)

ValuesFile = Annotated[Optional[Path], typer.Option("--values", "-f", help="YAML or JSON file of values "
                                                    "(`chatpipe k8s values` lists them); default: the defaults")]


def _render(values_file: Optional[Path]):
    from k8s.common import RenderError
    from k8s.render import render
    from k8s.values import load

    try:
        return render(load(values_file))
    except RenderError as exc:
        print_error(f"cannot render: {exc}")
        raise typer.Exit(1) from None


@app.command("render")
def render_command(
    values_file: ValuesFile = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Folder for the files (then `kubectl apply "
                                                "-k DIR`); default: print everything")] = None,
) -> None:
    """Render the manifests: Strimzi Kafka and topics, gateway, streams, inference, Qdrant, KEDA, Spark jobs."""
    from k8s.render import as_text, write

    rendered = _render(values_file)
    if out is None:
        typer.echo(as_text(rendered), nl=False)
    else:
        for path in write(rendered, out):
            err_console.print(f"wrote {path}", highlight=False)
    for note in rendered.notes:
        err_console.print(f"[yellow]{note}[/]", highlight=False, soft_wrap=True)


@app.command("values")
def values_command(as_json: Annotated[bool, typer.Option("--json", help="The defaults as one JSON object")] = False) -> None:
    """Every value a --values file may set, its default and what it does."""
    from k8s.values import Values, described

    if as_json:
        typer.echo(json.dumps(Values().model_dump(mode="json"), indent=2))
        return
    rows = described()
    sections = {key for key, _, _ in rows if any(other.startswith(f"{key}.") for other, _, _ in rows)}
    for key, default, description in rows:
        comment = f"    # {description}" if description else ""
        if key in sections:
            typer.echo(f"{key}:{comment}")
        else:
            typer.echo(f"{key} = {json.dumps(default) if default is not None else '(empty)'}{comment}")


@app.command("validate")
def validate_command(
    folder: Annotated[Optional[Path], typer.Argument(help="A rendered folder; default: render --values into a "
                                                          "temporary one")] = None,
    values_file: ValuesFile = None,
) -> None:
    """kubeconform -strict on the manifests with the vendored Kubernetes and CRD schemas (no network)."""
    import tempfile

    from k8s.kubeconform import validate
    from k8s.render import write

    with tempfile.TemporaryDirectory(prefix="chatpipe-k8s-") as tmp:
        if folder is None:
            folder = Path(tmp)
            write(_render(values_file), folder)
        files = sorted(p for p in folder.glob("*.yaml") if p.name != "kustomization.yaml")
        if not files:
            print_error(f"no manifests in {folder}")
            raise typer.Exit(1)
        result = validate(files, progress=lambda m: err_console.print(m, highlight=False))
    typer.echo(result.output)
    if not result.ok:
        raise typer.Exit(1)


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="k8s")
