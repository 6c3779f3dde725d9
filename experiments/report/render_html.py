"""The page as one static HTML file (``reports/index.html``): no external assets, relative links only,
so it opens from disk and from a CI artifact. A small inline script marks, once the page has loaded,
how many images it has and which failed to load (``data-images``, ``data-broken`` on <body>): what
the headless-browser test reads from the dumped DOM."""
from __future__ import annotations

import html

from .doc import Doc, Heading, Image, Link, Para, Table

_CSS = """
body{font-family:system-ui,sans-serif;max-width:1200px;margin:1em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1em;font-size:13px}
td,th{border:1px solid #ccc;padding:3px 6px;vertical-align:top}th{background:#f2f2f2}
td.v-reproduced,span.v-reproduced{background:#dff3df}td.v-contradicted,span.v-contradicted{background:#f8d7d7}
td.v-direction{background:#eef2f7}
img{max-width:100%;border:1px solid #eee;margin:.3em 0}
nav a{margin-right:.8em}table.claims td{max-width:24em}td a{word-break:break-word}
"""
_SCRIPT = """
window.addEventListener('load', function () {
  var imgs = Array.prototype.slice.call(document.images);
  var bad = imgs.filter(function (i) { return !(i.complete && i.naturalWidth > 0); })
                .map(function (i) { return i.getAttribute('src'); });
  document.body.setAttribute('data-images', String(imgs.length));
  document.body.setAttribute('data-broken', JSON.stringify(bad));
});
"""


def _cell(c) -> str:
    if isinstance(c, Link):
        return f'<a href="{html.escape(c.href)}">{html.escape(c.text)}</a>'
    if isinstance(c, tuple):
        return " ".join(_cell(x) for x in c)
    return html.escape(str(c))


def _css_class(row: tuple) -> list[str]:
    # verdict cells get a background: reproduced green, contradicted red; a measurement outside its
    # claim's regime (chain.measured_column) only shows a direction: a neutral tint, never red
    out = []
    for c in row:
        s = c if isinstance(c, str) else ""
        out.append(" class=\"v-contradicted\"" if s.startswith(("contradicted", "mixed")) else
                   " class=\"v-reproduced\"" if s.startswith("reproduced") else
                   " class=\"v-direction\"" if s.startswith("direction") else "")
    return out


def _block(b) -> str:
    if isinstance(b, Heading):
        return f'<h{b.level} id="{b.anchor}">{html.escape(b.text)}</h{b.level}>'
    if isinstance(b, Para):
        return f"<p>{_cell(b.pieces)}</p>"
    if isinstance(b, Table):
        head = "".join(f"<th>{html.escape(h)}</th>" for h in b.header)
        body = "".join("<tr>" + "".join(f"<td{cls}>{_cell(c)}</td>" for c, cls in zip(row, _css_class(row)))
                       + "</tr>" for row in b.rows)
        return f'<table class="{b.css}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
    if isinstance(b, Image):
        return f'<figure><img src="{html.escape(b.src)}" alt="{html.escape(b.alt)}"></figure>'
    raise TypeError(f"unknown block {b!r}")


def render_html(doc: Doc) -> str:
    nav = " ".join(f'<a href="#{h.anchor}">{html.escape(h.nav or h.text)}</a>' for h in doc.sections())
    body = "\n".join(_block(b) for b in doc.blocks)
    return (f"<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(doc.title)}"
            f"</title><style>{_CSS}</style><script>{_SCRIPT}</script></head>\n<body>\n<h1>{html.escape(doc.title)}"
            f"</h1>\n<nav>{nav}</nav>\n{body}\n</body></html>\n")
