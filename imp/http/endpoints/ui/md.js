// A small markdown renderer that builds DOM nodes.
//
// Model output is untrusted text: it only ever enters the page through
// createTextNode / textContent, never innerHTML, so "<script>" or
// "<img onerror=...>" in a reply shows as those characters. Links keep only
// http(s) and mailto targets, and images are shown as links, never loaded
// (a reply must not make the browser fetch anything).
//
// Covers what chat models write: fenced code (an unclosed fence while the
// reply streams is still code), headings, paragraphs with line breaks,
// nested lists, block quotes, tables, rules, and inline code, bold, italic,
// strike-through, links and bare URLs.
"use strict";

(function () {
  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  const SAFE_URL = /^(https?:\/\/|mailto:)/i;

  // One alternation, earliest match wins. Groups:
  // 1-2 code span, 3 **strong**, 4 __strong__, 5 ~~del~~, 6 *em*, 7 _em_,
  // 8-10 [link](url) (8 = "!" for an image), 11 bare URL.
  const INLINE =
    "(`+)([^`]|[^`][\\s\\S]*?[^`])\\1(?!`)" +
    "|\\*\\*(?!\\s)([\\s\\S]+?)\\*\\*" +
    "|(?<![A-Za-z0-9_])__(?![\\s_])([\\s\\S]+?)__(?![A-Za-z0-9_])" + // like _em_: never inside a word (window.__x)
    "|~~(?!\\s)([\\s\\S]+?)~~" +
    "|\\*(?![\\s*])([\\s\\S]+?)\\*" +
    "|(?<![A-Za-z0-9_])_(?![\\s_])([\\s\\S]+?)_(?![A-Za-z0-9_])" +
    "|(!?)\\[([^\\]\\n]+)\\]\\(([^()\\s]+)\\)" +
    "|(https?:\\/\\/[^\\s<>()\"']*[^\\s<>()\"'.,;:!?])";

  function inline(text, parent) {
    // a fresh regex per call: recursion would clobber a shared lastIndex
    const re = new RegExp(INLINE, "g");
    let last = 0;
    let m;
    while ((m = re.exec(text)) !== null) {
      if (m.index > last) parent.append(document.createTextNode(text.slice(last, m.index)));
      last = re.lastIndex;
      if (m[1] !== undefined) {
        parent.append(el("code", null, m[2].trim() || m[2]));
      } else if (m[3] !== undefined || m[4] !== undefined) {
        inline(m[3] ?? m[4], parent.appendChild(el("strong")));
      } else if (m[5] !== undefined) {
        inline(m[5], parent.appendChild(el("del")));
      } else if (m[6] !== undefined || m[7] !== undefined) {
        inline(m[6] ?? m[7], parent.appendChild(el("em")));
      } else if (m[9] !== undefined) {
        parent.append(link(m[10], m[9], m[8] === "!"));
      } else if (m[11] !== undefined) {
        parent.append(link(m[11], m[11], false));
      }
    }
    if (last < text.length) parent.append(document.createTextNode(text.slice(last)));
  }

  function link(url, label, image) {
    if (!SAFE_URL.test(url)) {
      // not a scheme we follow: keep what the model wrote, as text
      return document.createTextNode((image ? "!" : "") + "[" + label + "](" + url + ")");
    }
    const a = el("a");
    a.href = url;
    a.target = "_blank";
    a.rel = "noopener noreferrer nofollow";
    a.textContent = (image ? "image: " : "") + label; // plain: no link inside a link
    return a;
  }

  function codeBlock(code, lang) {
    const box = el("div", "code");
    const head = box.appendChild(el("div", "code-head"));
    head.append(el("span", "code-lang", lang || "text"));
    const copy = head.appendChild(el("button", "copy", "Copy"));
    copy.type = "button";
    copy.addEventListener("click", () => copyText(code, copy));
    const pre = box.appendChild(el("pre"));
    pre.append(el("code", lang ? "lang-" + lang.replace(/[^\w-]/g, "") : null, code));
    return box;
  }

  function copyText(text, button) {
    const done = () => {
      button.textContent = "Copied";
      setTimeout(() => (button.textContent = "Copy"), 1200);
    };
    // navigator.clipboard exists only in secure contexts (http://127.0.0.1 is one,
    // a LAN address over http is not): fall back to a hidden textarea.
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(done, () => {});
      return;
    }
    const ta = el("textarea");
    ta.value = text;
    ta.setAttribute("readonly", "");
    ta.style.position = "fixed";
    ta.style.opacity = "0";
    document.body.append(ta);
    ta.select();
    try {
      document.execCommand("copy");
      done();
    } finally {
      ta.remove();
    }
  }

  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^\s`]*)/;
  const HEADING = /^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$/;
  const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
  const QUOTE = /^ {0,3}> ?/;
  const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
  const TABLE_SEP = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;
  const BLANK = /^\s*$/;

  const indent = (line) => line.match(/^\s*/)[0].length;
  const isTable = (lines, i) => lines[i].includes("|") && i + 1 < lines.length && lines[i + 1].includes("-") && TABLE_SEP.test(lines[i + 1]);
  const startsBlock = (lines, i) =>
    FENCE.test(lines[i]) || HEADING.test(lines[i]) || RULE.test(lines[i]) || QUOTE.test(lines[i]) || ITEM.test(lines[i]) || isTable(lines, i);

  function cells(row) {
    let s = row.trim();
    if (s.startsWith("|")) s = s.slice(1);
    if (s.endsWith("|") && !s.endsWith("\\|")) s = s.slice(0, -1);
    return s.split(/(?<!\\)\|/).map((c) => c.trim().replace(/\\\|/g, "|"));
  }

  function table(lines, i, out) {
    const head = cells(lines[i]);
    const align = cells(lines[i + 1]).map((c) => (c.endsWith(":") ? (c.startsWith(":") ? "center" : "right") : c.startsWith(":") ? "left" : ""));
    const wrap = out.appendChild(el("div", "table-wrap")); // scrolls sideways at phone width
    const t = wrap.appendChild(el("table"));
    const tr = t.appendChild(el("thead")).appendChild(el("tr"));
    head.forEach((c, k) => {
      const th = tr.appendChild(el("th"));
      if (align[k]) th.style.textAlign = align[k];
      inline(c, th);
    });
    const body = t.appendChild(el("tbody"));
    i += 2;
    while (i < lines.length && lines[i].includes("|") && !BLANK.test(lines[i])) {
      const row = body.appendChild(el("tr"));
      cells(lines[i]).forEach((c, k) => {
        const td = row.appendChild(el("td"));
        if (align[k]) td.style.textAlign = align[k];
        inline(c, td);
      });
      i++;
    }
    return i;
  }

  function list(lines, i, out) {
    const first = ITEM.exec(lines[i]);
    const ordered = /\d/.test(first[2]);
    const base = first[1].length;
    const l = out.appendChild(el(ordered ? "ol" : "ul"));
    if (ordered && parseInt(first[2], 10) !== 1) l.start = parseInt(first[2], 10);
    let item = null;
    let width = 0; // where an item's text starts: continuation lines are cut there
    let loose = false;
    const flush = () => {
      if (!item) return;
      const li = l.appendChild(el("li"));
      const inner = document.createDocumentFragment();
      blocks(item.join("\n"), inner);
      // a tight item shows its text without paragraph margins
      if (!loose) for (const p of [...inner.children]) if (p.tagName === "P") p.replaceWith(...p.childNodes);
      li.append(inner);
    };
    while (i < lines.length) {
      const line = lines[i];
      const m = ITEM.exec(line);
      if (m && m[1].length <= base + 1) {
        if (/\d/.test(m[2]) !== ordered) break; // the other kind of list starts
        flush();
        item = [m[3]];
        width = m[1].length + m[2].length + 1;
        i++;
        continue;
      }
      if (BLANK.test(line)) {
        const next = lines[i + 1];
        if (next !== undefined && !BLANK.test(next) && (indent(next) > base || (ITEM.test(next) && indent(next) >= base))) {
          loose = loose || indent(next) <= base + 1;
          item.push("");
          i++;
          continue;
        }
        break;
      }
      if (indent(line) > base) {
        item.push(line.slice(Math.min(indent(line), width)));
        i++;
        continue;
      }
      if (!startsBlock(lines, i)) {
        item.push(line); // lazy continuation of the item's paragraph
        i++;
        continue;
      }
      break;
    }
    flush();
    return i;
  }

  function paragraph(lines, out) {
    const p = out.appendChild(el("p"));
    lines.forEach((line, k) => {
      if (k) p.append(el("br"));
      inline(line.trim(), p);
    });
  }

  function blocks(src, out) {
    const lines = src.replace(/\r\n?/g, "\n").split("\n");
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if ((m = FENCE.exec(line))) {
        const close = new RegExp("^ {0,3}" + (m[1][0] === "`" ? "`" : "~") + "{" + m[1].length + ",}\\s*$");
        const body = [];
        i++;
        while (i < lines.length && !close.test(lines[i])) body.push(lines[i++]);
        i++; // the closing fence; past the end while the reply is still streaming
        out.append(codeBlock(body.join("\n"), m[2]));
      } else if (BLANK.test(line)) {
        i++;
      } else if ((m = HEADING.exec(line))) {
        inline(m[2], out.appendChild(el("h" + Math.min(m[1].length + 2, 6)))); // h3..h6: replies sit under the page's own headings
        i++;
      } else if (RULE.test(line)) {
        out.append(el("hr"));
        i++;
      } else if (QUOTE.test(line)) {
        const inner = [];
        while (i < lines.length && (QUOTE.test(lines[i]) || (!BLANK.test(lines[i]) && !startsBlock(lines, i)))) {
          inner.push(lines[i++].replace(QUOTE, ""));
        }
        blocks(inner.join("\n"), out.appendChild(el("blockquote")));
      } else if (ITEM.test(line)) {
        i = list(lines, i, out);
      } else if (isTable(lines, i)) {
        i = table(lines, i, out);
      } else {
        const para = [];
        while (i < lines.length && !BLANK.test(lines[i]) && (para.length === 0 || !startsBlock(lines, i))) para.push(lines[i++]);
        paragraph(para, out);
      }
    }
    return out;
  }

  // render(text) -> DocumentFragment of safe nodes
  window.impMarkdown = { render: (text) => blocks(text, document.createDocumentFragment()) };
})();
