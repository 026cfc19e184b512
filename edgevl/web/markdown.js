// A small Markdown renderer for model answers. A model's answer is untrusted text, so this builds
// DOM nodes and sets only textContent: no string ever becomes HTML, whatever it contains. It knows
// the blocks chat answers use (paragraphs, headings, lists, quotes, fenced code) and inline code,
// bold, italics and links (http, https and mailto only; a URL may hold parentheses, as Wikipedia's
// do); anything else stays plain text.
"use strict";

(function () {
  const SAFE_LINK = /^(https?:|mailto:)/i;
  const INLINE = /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)|\*\*([^*\n]+)\*\*|__([^_\n]+)__|\*([^*\s][^*\n]*?)\*|\b_([^_\n]+)_\b|\[([^\]\n]+)\]\(((?:[^()\s]|\([^()\s]*\))+)\)/g;

  function el(tag, cls) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    return e;
  }

  function inline(text, parent) {
    let last = 0;
    for (const m of text.matchAll(INLINE)) {
      if (m.index > last) parent.append(text.slice(last, m.index));
      if (m[2] !== undefined) {
        const c = el("code");
        c.textContent = m[2];
        parent.append(c);
      } else if (m[3] !== undefined || m[4] !== undefined) {
        const b = el("strong");
        inline(m[3] ?? m[4], b);
        parent.append(b);
      } else if (m[5] !== undefined || m[6] !== undefined) {
        const i = el("em");
        inline(m[5] ?? m[6], i);
        parent.append(i);
      } else if (SAFE_LINK.test(m[8])) {
        const a = el("a");
        a.href = m[8];
        a.target = "_blank";
        a.rel = "noopener noreferrer";
        a.textContent = m[7];
        parent.append(a);
      } else {
        parent.append(m[0]);  // a javascript: or other link stays text
      }
      last = m.index + m[0].length;
    }
    if (last < text.length) parent.append(text.slice(last));
  }

  function lines(block, parent) {
    // a line break inside a paragraph is kept: chat answers use them as such
    block.forEach((line, k) => {
      if (k) parent.append(el("br"));
      inline(line, parent);
    });
  }

  function render(text, container) {
    container.replaceChildren();
    const src = String(text).replace(/\r\n?/g, "\n").split("\n");
    let i = 0;
    while (i < src.length) {
      const line = src[i];
      const fence = line.match(/^\s*(`{3,}|~{3,})\s*([\w+-]*)/);
      if (fence) {
        // closed by a line of the same character, at least as long (a longer fence can hold a shorter one)
        const closes = (l) => { const t = l.trim(); return t.length >= fence[1].length && /^(`+|~+)$/.test(t) && t[0] === fence[1][0]; };
        const body = [];
        for (i++; i < src.length && !closes(src[i]); i++) body.push(src[i]);
        i++;  // the closing fence (or the end of an answer still streaming)
        const pre = el("pre");
        const code = el("code");
        if (fence[2]) code.dataset.lang = fence[2];
        code.textContent = body.join("\n");
        pre.append(code);
        container.append(pre);
        continue;
      }
      const head = line.match(/^(#{1,6})\s+(.*)$/);
      if (head) {
        const h = el("h" + Math.min(head[1].length + 2, 6));
        inline(head[2], h);
        container.append(h);
        i++;
        continue;
      }
      const item = line.match(/^\s*([-*+]|\d+[.)])\s+/);
      if (item) {
        const ordered = /\d/.test(item[1]);
        const list = el(ordered ? "ol" : "ul");
        if (ordered && parseInt(item[1], 10) !== 1) list.start = parseInt(item[1], 10);
        while (i < src.length) {
          const m = src[i].match(/^\s*([-*+]|\d+[.)])\s+(.*)$/);
          if (!m || /\d/.test(m[1]) !== ordered) break;
          const li = el("li");
          inline(m[2], li);
          list.append(li);
          i++;
        }
        container.append(list);
        continue;
      }
      if (/^\s*>/.test(line)) {
        const quote = el("blockquote");
        const body = [];
        for (; i < src.length && /^\s*>/.test(src[i]); i++) body.push(src[i].replace(/^\s*>\s?/, ""));
        lines(body, quote);
        container.append(quote);
        continue;
      }
      if (!line.trim()) {
        i++;
        continue;
      }
      const para = [];
      for (; i < src.length && src[i].trim() && !/^\s*(```|~~~|#{1,6}\s|>|[-*+]\s|\d+[.)]\s)/.test(src[i]); i++) {
        para.push(src[i]);
      }
      if (!para.length) para.push(src[i++]);  // a line the block rules did not take after all
      const p = el("p");
      lines(para, p);
      container.append(p);
    }
  }

  window.EdgevlMarkdown = { render };
})();
