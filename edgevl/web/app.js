// The chat page of `edgevl serve`. It uses only the server's public API: GET props (what the model
// takes), POST v1/chat/completions streamed as Server-Sent Events. Text from the model or from file
// names is only ever set as textContent (markdown.js builds its nodes the same way).
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  const STORE = "edgevl.conversations", SETTINGS = "edgevl.settings", KEY = "edgevl.apiKey";
  const FIELDS = ["temperature", "top_p", "max_tokens", "seed"];
  const IMAGE_TYPES = "PNG, JPEG, WebP, GIF, BMP or TIFF";
  // what the server reads (an SVG or a HEIC the browser may show would be refused there)
  const IMAGE_MIME = ["image/png", "image/jpeg", "image/webp", "image/gif", "image/bmp", "image/tiff"];

  let props = null;          // GET props, once the server answered
  let conversations = load(STORE, []).filter((c) => c && Array.isArray(c.messages));
  let settings = load(SETTINGS, {});
  let current = null;        // the conversation shown
  let pending = [];          // files attached to the next message: {kind, name, mime, url}
  let busy = null;           // {controller} while an answer streams
  let seen = 0;              // the \`updated\` of the shown conversation as this tab last read or wrote it
  let editing = null;        // {m, text, files}: the question being edited, as the edit has it
  let leaving = false;       // the page is closing: a failed read then is no unreachable server
  const unsaved = new Set(); // conversations the browser's storage could not hold (their ids)
  const written = new Set(conversations.map((c) => c.id)); // conversations known to be in the storage
  const deleted = new Set(); // ... that another tab deleted since: not written back

  function load(key, fallback) {
    try {
      const v = JSON.parse(localStorage.getItem(key));
      return v !== null && typeof v === typeof fallback && Array.isArray(v) === Array.isArray(fallback) ? v : fallback;
    } catch (e) {
      return fallback;
    }
  }

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function headers() {
    const h = { "Content-Type": "application/json" };
    const key = localStorage.getItem(KEY);
    if (key) h.Authorization = "Bearer " + key;
    return h;
  }

  async function errorText(resp) {
    // the server's errors are {"error": {"message": ...}}; anything else is shown as it came
    const raw = await resp.text();
    try {
      const msg = JSON.parse(raw).error.message;
      if (msg) return msg;
    } catch (e) { /* not JSON */ }
    return (raw.trim().split("\n")[0] || resp.statusText || "no details").slice(0, 300);
  }

  function banner(text) {
    const b = $("banner");
    b.textContent = text || "";
    b.hidden = !text;
  }

  // -- the model ----------------------------------------------------------------------------------
  async function loadProps() {
    let resp;
    try {
      resp = await fetch("props", { headers: headers() });
    } catch (e) {
      banner("The server cannot be reached (" + e.message + "); is `edgevl serve` still running?");
      return;
    }
    if (resp.status === 401) {
      askKey(localStorage.getItem(KEY) ? "The server refused the key; enter the right one." : "");
      return;
    }
    if (!resp.ok) {
      banner("The server did not describe its model: " + (await errorText(resp)));
      return;
    }
    props = await resp.json();
    banner("");
    showModel();
  }

  function showModel() {
    $("model-name").textContent = props.model;
    const caps = [props.images ? "images" : "text only"];
    if (props.video) caps.push("video");
    if (props.thinking.reasoning) caps.push("thinking");
    if (props.speculative !== "none") caps.push("speculative decoding");
    caps.push(props.context + "-token context");
    $("model-caps").textContent = caps.join(" · ");
    $("thinking-switch").hidden = !props.thinking.switch;
    $("thinking").checked = settings.thinking ?? props.thinking.default;
    $("attach").hidden = !props.images;
    const input = $("file-input");
    input.accept = props.video ? "image/*,video/*" : "image/*";
    $("prompt").placeholder = props.needs_image
      ? "Attach an image and ask about it (Enter sends, Shift+Enter: new line)"
      : "Ask something (Enter sends, Shift+Enter: new line)";
    FIELDS.forEach((f) => {
      const v = props.defaults[f];
      $("set-" + f).placeholder = v === null || v === undefined ? (f === "max_tokens" ? "to the context end" : "none") : String(v);
    });
  }

  function askKey(note) {
    const n = $("key-note");
    n.textContent = note || "";
    n.hidden = !note;
    if (!$("key-dialog").open) $("key-dialog").showModal();
    $("api-key").focus();
  }

  $("key-form").addEventListener("submit", () => {
    localStorage.setItem(KEY, $("api-key").value.trim());
    $("api-key").value = "";
    loadProps();
  });

  // -- conversations --------------------------------------------------------------------------------
  function newConversation() {
    return { id: Date.now().toString(36) + Math.random().toString(36).slice(2, 6), title: "", messages: [],
             updated: Date.now() };
  }

  function stored() {
    // what the storage holds now: other tabs of this page write to it too
    return load(STORE, []).filter((c) => c && Array.isArray(c.messages));
  }

  function write(list) {
    try {
      localStorage.setItem(STORE, JSON.stringify(list));
      return true;
    } catch (e) {
      return false;
    }
  }

  function save() {
    // Only the conversation shown is written; the others are taken as the storage has them, so
    // two tabs never write over each other's conversations.
    const all = stored();   // read once: with its images it may be megabytes of JSON
    const theirs = all.find((c) => c.id === current.id);
    if (!theirs && written.has(current.id)) {
      // another tab deleted it (while this one was answering): the deletion stands
      deleted.add(current.id);
      renderMessages();
      return;
    }
    if (theirs && theirs.updated > seen) {
      // another tab wrote this conversation since this one read it (both asked at once): this
      // tab's turns are kept as a conversation of their own, not written over the other's
      current.id = newConversation().id;
    }
    current.updated = Math.max(Date.now(), seen + 1);
    const first = current.messages.find((m) => m.role === "user");
    current.title = first ? (first.text.trim().split("\n")[0] || first.files.map((f) => f.name).join(", ")).slice(0, 60) : "";
    const before = all.find((c) => c.id === current.id);
    const others = all.filter((c) => c.id !== current.id).sort((a, b) => b.updated - a.updated);
    const mine = current.messages.length ? [current] : [];
    let kept = [...mine, ...others];
    unsaved.delete(current.id);
    if (!write(kept)) {
      // images make conversations large. This one first, then the others newest first, each
      // while it fits: a conversation too large for the storage costs no other its place
      kept = [];
      const candidates = [...mine, ...others];
      if (mine.length && !write(mine)) {
        unsaved.add(current.id);
        candidates.splice(0, 1, ...(before ? [before] : []));   // its last stored turns stay
      }
      for (const c of candidates) if (write([...kept, c])) kept.push(c);
    }
    seen = current.updated;
    if (mine.length && kept.includes(current)) written.add(current.id);
    conversations = [...mine, ...kept.filter((c) => c.id !== current.id)];
    renderList();
  }

  function forget(c) {
    write(stored().filter((x) => x.id !== c.id));
    conversations = conversations.filter((x) => x.id !== c.id);
    unsaved.delete(c.id);
  }

  // another tab saved or deleted a conversation: list what the storage holds (this tab's own
  // conversation as this tab has it)
  window.addEventListener("storage", (e) => {
    if (e.key !== null && e.key !== STORE) return;
    const all = stored();
    all.forEach((c) => written.add(c.id));
    const theirs = all.find((c) => c.id === current.id);
    const last = theirs && theirs.messages[theirs.messages.length - 1];
    // not while the other tab's question waits for its answer: asking here then would send that
    // question too; this tab's turns then go to a conversation of their own (save)
    if (theirs && theirs.updated > seen && !busy && !editing && !(last && last.role === "user")) {
      // the other tab went on with the conversation shown here: show its turns (this tab's
      // next question then follows them instead of writing over them)
      current = theirs;
      seen = theirs.updated;
      renderMessages();
    }
    const others = all.filter((c) => c.id !== current.id);
    conversations = [...(current.messages.length ? [current] : []), ...others]
      .sort((a, b) => b.updated - a.updated);
    renderList();
  });

  function renderList() {
    const ul = $("conversations");
    ul.replaceChildren();
    for (const c of conversations) {
      const li = el("li", c.id === current.id ? "active" : "");
      const open = el("button", "open", c.title || "(untitled)");
      open.type = "button";
      open.addEventListener("click", () => {
        if (busy) return;
        show(c);
        document.body.classList.remove("show-chats");
      });
      const del = el("button", "delete", "×");
      del.type = "button";
      del.title = "Delete this conversation";
      del.addEventListener("click", () => {
        if (busy && c === current) return;
        forget(c);
        if (c === current) show(newConversation());
        else renderList();
      });
      li.append(open, del);
      ul.append(li);
    }
  }

  function show(conv) {
    current = conv;
    seen = conv.updated || 0;
    editing = null;
    renderMessages();
    renderList();
  }

  $("new-chat").addEventListener("click", () => {
    if (busy) return;
    pending = [];
    renderPending();
    show(newConversation());
    document.body.classList.remove("show-chats");
    $("prompt").focus();
  });

  // on a narrow screen the list of conversations opens over the page
  $("chats-button").addEventListener("click", () => document.body.classList.toggle("show-chats"));
  // ... and Escape, or a tap beside it, closes it again (it covers the button)
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape") document.body.classList.remove("show-chats");
  });
  document.addEventListener("click", (e) => {
    if (!document.contains(e.target)) return;   // a button the click redrew away (a list entry's ×): inside
    if (document.body.classList.contains("show-chats") && !$("sidebar").contains(e.target)
        && e.target !== $("chats-button")) document.body.classList.remove("show-chats");
  });

  // -- messages ------------------------------------------------------------------------------------
  function imagesBefore(index) {
    // the request's images in order: a box's `image` is an index into them
    // (as requestBody sent them: a turn the server refused was left out, with its files)
    const out = [];
    current.messages.slice(0, index).forEach((m, k) => {
      if (m.role === "user" && !leftOut(current.messages, k)) m.files.forEach((f) => { if (f.kind === "image") out.push(f); });
    });
    return out;
  }

  function thumb(f) {
    const fig = el("figure", "thumb");
    if (f.kind === "video" && !f.mime.startsWith("image/")) {  // an animated GIF shows as an image
      const v = el("video");
      v.src = f.url;
      v.muted = true;
      v.controls = true;
      v.preload = "metadata";
      fig.append(v);
    } else {
      const im = el("img");
      // a TIFF goes to the server, which reads it; this browser cannot show it
      im.addEventListener("error", () => im.replaceWith(el("div", "no-preview", "no preview")), { once: true });
      im.src = f.url;
      im.alt = f.name;
      fig.append(im);
    }
    fig.append(el("figcaption", "", f.name));
    return fig;
  }

  function removable(f, remove) {
    // a file's thumbnail with its × button (files waiting to be sent, and a question being edited)
    const t = thumb(f);
    const x = el("button", "remove", "×");
    x.type = "button";
    x.title = "Remove";
    x.addEventListener("click", remove);
    t.append(x);
    return t;
  }

  function boxedImage(file, boxes) {
    // the image with the answer's boxes as labelled elements over it, placed in percent of the
    // image's own pixels so they follow its displayed size
    const fig = el("figure", "boxed");
    const frame = el("div", "frame");
    const im = el("img");
    im.alt = file.name;
    frame.append(im);
    im.addEventListener("load", () => {
      const w = im.naturalWidth, h = im.naturalHeight;
      boxes.forEach(({ b, n }) => {
        const [x1, y1, x2, y2] = b.box;
        const d = el("div", "box");
        d.style.left = (100 * x1 / w) + "%";
        d.style.top = (100 * y1 / h) + "%";
        d.style.width = (100 * (x2 - x1 + 1) / w) + "%";
        d.style.height = (100 * (y2 - y1 + 1) / h) + "%";
        d.style.setProperty("--c", COLORS[n % COLORS.length]);
        d.dataset.box = b.box.join(",");
        d.append(el("span", "box-label", b.label || "box " + (n + 1)));
        frame.append(d);
      });
    }, { once: true });
    im.addEventListener("error", () => {   // a TIFF: the boxes as text, the browser cannot draw its pixels
      frame.replaceChildren(...boxes.map(({ b, n }) => el("div", "box-text",
        (b.label || "box " + (n + 1)) + ": x " + b.box[0] + "-" + b.box[2] + ", y " + b.box[1] + "-" + b.box[3])));
    }, { once: true });
    im.src = file.url;
    fig.append(frame, el("figcaption", "", file.name + (file.mime === "image/tiff" ? " (this browser cannot show it)" : "")));
    return fig;
  }
  const COLORS = ["#e6194b", "#3cb44b", "#4363d8", "#f58231", "#911eb4", "#42d4f4", "#f032e6", "#bfef45"];

  function renderMessage(m, index) {
    const div = el("div", "msg " + m.role);
    div.dataset.index = index;
    const last = index === current.messages.length - 1;
    if (m.role === "user") {
      if (editing && editing.m === m) return renderEditor(m, index, div);
      if (m.files.length) {
        const files = el("div", "files");
        m.files.forEach((f) => files.append(thumb(f)));
        div.append(files);
      }
      div.append(el("div", "content user-text", m.text));
      const actions = el("div", "actions");
      const edit = el("button", "edit", "Edit");
      edit.type = "button";
      edit.addEventListener("click", () => {
        if (!busy) { editing = { m, text: m.text, files: [...m.files] }; renderMessages(); }
      });
      actions.append(edit);
      div.append(actions);
      return div;
    }
    div.dataset.state = m.streaming ? "streaming" : "done";
    if (m.reasoning || m.thinking) {
      const d = el("details", "reasoning");
      const s = el("summary", "", m.thinking ? "Thinking…" : "Thoughts" + (m.thought ? " (" + m.thought.toFixed(1) + " s)" : ""));
      d.append(s, el("div", "reasoning-text", m.reasoning));
      // the answer is drawn again as it streams: an unfolded reasoning stays unfolded
      d.open = !!m.unfolded;
      d.addEventListener("toggle", () => { m.unfolded = d.open; });
      div.append(d);
    }
    const content = el("div", "content");
    window.EdgevlMarkdown.render(m.text, content);
    div.append(content);
    if (m.boxes && m.boxes.length) {
      const images = imagesBefore(index);
      const byImage = new Map();
      m.boxes.forEach((b, n) => {
        const k = b.image ?? 0;
        if (!byImage.has(k)) byImage.set(k, []);
        byImage.get(k).push({ b, n });
      });
      const figs = el("div", "figures");
      for (const [k, boxes] of byImage) if (images[k]) figs.append(boxedImage(images[k], boxes));
      div.append(figs);
    }
    if (m.stopped) div.append(el("div", "note", "Stopped."));
    if (m.finish === "length" && !m.error) {
      div.append(el("div", "note", "The answer reached the token limit (max tokens in the settings, or the context's end)."));
    }
    if (m.error) div.append(el("div", "error", m.error));
    if (m.hint) div.append(el("div", "note hint", m.hint));
    if (m.refused && !last) div.append(el("div", "note", "This turn is left out of the next requests."));
    if (m.stats) div.append(el("div", "stats", statsText(m.stats)));
    if (last && !m.streaming) {
      const actions = el("div", "actions");
      const again = el("button", "regenerate", "Regenerate");
      again.type = "button";
      again.addEventListener("click", regenerate);
      actions.append(again);
      div.append(actions);
    }
    return div;
  }

  function renderEditor(m, index, div) {
    // the edit works on a draft (editing): Cancel leaves the question as it was
    const box = el("textarea", "edit-text");
    box.value = editing.text;
    const resend = el("button", "resend", "Send");
    resend.type = "button";
    const cancel = el("button", "cancel", "Cancel");
    cancel.type = "button";
    resend.addEventListener("click", () => {
      if (busy) return;
      if (!box.value.trim() && !editing.files.length) return;   // as the input box, no empty question
      // the turn is sent again as edited: what followed it is dropped
      current.messages = current.messages.slice(0, index + 1);
      m.text = box.value;
      m.files = editing.files;
      editing = null;
      answer();
    });
    cancel.addEventListener("click", () => { editing = null; renderMessages(); });
    box.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        resend.click();
      }
    });
    const actions = el("div", "actions");
    actions.append(resend, cancel);
    if (editing.files.length) {
      // a file the server refused can be taken out here (the edit keeps what is left)
      const files = el("div", "files");
      editing.files.forEach((f, k) => files.append(removable(f, () => {
        editing.files = editing.files.filter((_, j) => j !== k);
        editing.text = box.value;
        renderMessages();
      })));
      div.append(files);
    }
    div.append(box, actions);
    setTimeout(() => box.focus());
    return div;
  }

  function statsText(s) {
    const parts = [s.tokens + " tokens"];
    if (s.ttft !== null) parts.push("first token " + s.ttft.toFixed(2) + " s");
    if (s.tps !== null) parts.push(s.tps.toFixed(1) + " tokens/s");
    if (s.drafted !== undefined) parts.push(s.accepted + " of " + s.drafted + " drafted tokens accepted");
    if (s.prompt !== undefined) parts.push("prompt " + s.prompt + (s.cached ? " (" + s.cached + " cached)" : ""));
    return parts.join(" · ");
  }

  function renderMessages() {
    const box = $("messages");
    const atEnd = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
    box.replaceChildren();
    if (!current.messages.length) {
      const hint = el("div", "empty");
      hint.append(el("p", "", props && props.needs_image
        ? "This model answers questions about an image: attach one (picker, drag and drop, or paste), then ask."
        : "Ask something" + (props && props.images ? ", with images if you like (picker, drag and drop, or paste)." : ".")));
      box.append(hint);
    }
    current.messages.forEach((m, i) => box.append(renderMessage(m, i)));
    if (unsaved.has(current.id)) box.append(el("div", "note", "This conversation is too large for the browser's storage (its images): it will not be kept after a reload."));
    if (deleted.has(current.id)) box.append(el("div", "note", "This conversation was deleted in another tab: it will not be kept after a reload."));
    if (atEnd || busy) box.scrollTop = box.scrollHeight;
  }

  function renderLast() {
    // while an answer streams only its own message is drawn again (the images above stay put)
    const box = $("messages");
    const i = current.messages.length - 1;
    const old = box.querySelector('.msg[data-index="' + i + '"]');
    if (!old) return renderMessages();
    const atEnd = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
    old.replaceWith(renderMessage(current.messages[i], i));
    if (atEnd) box.scrollTop = box.scrollHeight;
  }

  // -- sending -------------------------------------------------------------------------------------
  function leftOut(messages, k) {
    // a question the server refused (its files, its length) would be refused again: it is left
    // out of the requests after it, with its error (not the one being asked now: no answer yet)
    const next = messages[k + 1];
    return messages[k].role === "user" && !!next && !!next.refused;
  }

  function requestBody(messages) {
    const out = [];
    if ((settings.system || "").trim()) out.push({ role: "system", content: settings.system });
    messages.forEach((m, k) => {
      if (leftOut(messages, k)) return;
      if (m.role === "user") {
        const parts = m.files.map((f) => f.kind === "video"
          ? { type: "video_url", video_url: { url: f.url } }
          : { type: "image_url", image_url: { url: f.url } });
        out.push({ role: "user", content: parts.length ? [...parts, { type: "text", text: m.text }] : m.text });
      } else if (m.text) {
        out.push({ role: "assistant", content: m.text });  // a failed or empty turn is left out
      }
    });
    const body = { model: props.model, messages: out, stream: true, stream_options: { include_usage: true } };
    for (const f of FIELDS) if (settings[f] !== undefined && settings[f] !== "") body[f] = Number(settings[f]);
    if (props.thinking.switch) body.chat_template_kwargs = $("thinking").checked ? props.thinking.on : props.thinking.off;
    return body;
  }

  async function answer() {
    if (!props) {
      await loadProps();
      if (!props) return;
    }
    const m = { role: "assistant", text: "", reasoning: "", boxes: [], streaming: true };
    const body = requestBody(current.messages);
    current.messages.push(m);
    const controller = new AbortController();
    busy = { controller };
    setBusy(true);
    renderMessages();
    const t0 = performance.now();
    let first = null, end = null, usage = null, done = false, thinkStart = null;
    let drawn = false;
    const redraw = () => {
      if (drawn) return;
      drawn = true;
      requestAnimationFrame(() => { drawn = false; renderLast(); });
    };
    try {
      const resp = await fetch("v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body),
                                                         signal: controller.signal });
      if (!resp.ok) {
        const why = await errorText(resp);
        m.error = (resp.status === 401 ? "The server needs its API key: " : "The server refused the request (" + resp.status + "): ") + why;
        // the request's own fault (a file, the length, a setting): not sent again with later turns
        m.refused = resp.status === 400 || resp.status === 413 || resp.status === 415 || resp.status === 422;
        if (resp.status === 401) askKey("The server refused the key; enter the right one.");
        if (m.refused) m.hint = earlierCause(body, why);
      } else {
        const reader = resp.body.getReader();
        const decoder = new TextDecoder();
        let buf = "";
        for (;;) {
          const { value, done: eof } = await reader.read();
          if (eof) break;
          buf += decoder.decode(value, { stream: true });
          let cut;
          while ((cut = buf.indexOf("\n\n")) >= 0) {
            const event = buf.slice(0, cut);
            buf = buf.slice(cut + 2);
            const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
            if (!data) continue;  // a comment: the server checking the connection
            if (data === "[DONE]") { done = true; continue; }
            const obj = JSON.parse(data);
            if (obj.error) { m.error = "The answer failed: " + obj.error.message; continue; }
            if (obj.usage) usage = obj.usage;
            const ch = obj.choices && obj.choices[0];
            if (!ch) continue;
            const d = ch.delta || {};
            if (d.reasoning_content) {
              if (first === null) first = performance.now();
              if (thinkStart === null) thinkStart = performance.now();
              m.reasoning += d.reasoning_content;
              m.thinking = true;
            }
            if (d.content) {
              if (first === null) first = performance.now();
              if (m.thinking) { m.thinking = false; m.thought = (performance.now() - thinkStart) / 1000; }
              m.text += d.content;
            }
            if (d.boxes) m.boxes = d.boxes;
            if (ch.finish_reason) m.finish = ch.finish_reason;
            redraw();
          }
        }
        end = performance.now();
        if (!done && !m.error && leaving) m.stopped = true;
        else if (!done && !m.error) m.error = "The answer was cut off: the connection to the server closed.";
      }
    } catch (e) {
      if (e.name === "AbortError" || leaving) m.stopped = true;   // Stop, or the page closing
      else m.error = "The server cannot be reached (" + e.message + "); is `edgevl serve` still running?";
    }
    end = end ?? performance.now();
    if (m.thinking) { m.thinking = false; m.thought = (end - thinkStart) / 1000; }
    delete m.streaming;
    if (usage) {
      const n = usage.completion_tokens;
      const served = (usage.timings || {}).predicted_per_second;  // the server's own measure, when it gives one
      m.stats = { tokens: n, ttft: first === null ? null : (first - t0) / 1000,
                  tps: served || (first !== null && n > 1 && end > first ? (n - 1) / ((end - first) / 1000) : null),
                  prompt: usage.prompt_tokens, cached: (usage.prompt_tokens_details || {}).cached_tokens || 0 };
      if (usage.speculative) Object.assign(m.stats, usage.speculative);
    }
    busy = null;
    setBusy(false);
    save();
    renderMessages();
  }

  function earlierCause(body, why) {
    // a refusal the earlier turns cause would meet every later question too: say so
    const turns = body.messages.filter((x) => x.role !== "system");
    if (turns.length < 2) return undefined;
    const hasFiles = (x) => Array.isArray(x.content) && x.content.some((p) => p.type !== "text");
    const filesNow = hasFiles(turns[turns.length - 1]);
    const filesBefore = turns.slice(0, -1).some(hasFiles);
    if (/maximum context length/.test(why)) {
      return "If the earlier turns fill the context, start a New chat (or Edit an earlier question); if this "
        + "question alone is too long, shorten it.";
    }
    if (!filesNow && filesBefore && /image|video|frame|clip/i.test(why)) {
      return "A file of an earlier turn is the cause: start a New chat (or Edit that question and remove the file).";
    }
    return undefined;
  }

  function setBusy(on) {
    $("send").hidden = on;
    $("stop").hidden = !on;
    document.body.classList.toggle("busy", on);
  }

  function regenerate() {
    if (busy) return;
    const last = current.messages[current.messages.length - 1];
    if (last && last.role === "assistant") current.messages.pop();
    if (current.messages.length) answer();
  }

  $("stop").addEventListener("click", () => { if (busy) busy.controller.abort(); });

  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    if (busy) return;
    const text = $("prompt").value;
    if (!text.trim() && !pending.length) return;
    if (!props) {   // not described yet (no server, or a key to ask for): the question stays in the box
      loadProps();
      return;
    }
    const imaged = pending.length || current.messages.some((m) => m.role === "user" && m.files.length);
    // sent all the same, as `edgevl run` does: the note says why the answer means nothing
    fileNote(props && props.needs_image && !imaged
      ? ["This model answers questions about an image only: attach one, or its answer means nothing."] : []);
    current.messages.push({ role: "user", text, files: pending });
    pending = [];
    renderPending();
    $("prompt").value = "";
    save();   // the question is kept even if the page closes before the answer
    answer();
  });

  // the page closes or reloads while an answer streams: what came so far is kept, as stopped
  window.addEventListener("pagehide", () => {
    leaving = true;
    if (!busy) return;
    const m = current.messages[current.messages.length - 1];
    delete m.streaming;
    m.stopped = true;
    save();
  });

  window.addEventListener("pageshow", () => { leaving = false; });   // back from the browser's page cache

  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });

  // -- files ---------------------------------------------------------------------------------------
  function fileNote(lines) {
    const n = $("file-note");
    n.replaceChildren(...lines.map((l) => el("div", "", l)));
    n.hidden = !lines.length;
  }

  function readAs(file, how) {
    return new Promise((resolve, reject) => {
      const r = new FileReader();
      r.onload = () => resolve(r.result);
      r.onerror = () => reject(r.error);
      r[how](file);
    });
  }

  function decodes(url, kind) {
    // whether the browser can show it: a damaged or mislabelled file is caught before sending
    return new Promise((resolve) => {
      const e = document.createElement(kind === "video" ? "video" : "img");
      if (kind === "video") {
        e.onloadedmetadata = () => resolve(true);
        e.preload = "metadata";
      } else {
        e.onload = () => resolve(e.naturalWidth > 0);
      }
      e.onerror = () => resolve(false);
      e.src = url;
    });
  }

  function gifFrames(bytes) {
    // frames of a GIF: its image descriptors, found by walking its blocks (the bytes of a frame's
    // data may look like any marker)
    const table = (flags) => (flags & 0x80 ? 3 << ((flags & 7) + 1) : 0);
    const subBlocks = (i) => { while (i < bytes.length && bytes[i]) i += bytes[i] + 1; return i + 1; };
    let i = 13 + table(bytes[10]), n = 0;
    while (i < bytes.length) {
      if (bytes[i] === 0x2c) {          // an image: descriptor, local colours, LZW size, data
        n++;
        i = subBlocks(i + 10 + table(bytes[i + 9]) + 1);
      } else if (bytes[i] === 0x21) {   // an extension: label, then its sub-blocks
        i = subBlocks(i + 2);
      } else {
        break;                          // the trailer (3B), or a file cut short
      }
    }
    return n;
  }

  function sniff(bytes) {
    // the image type from a file's first bytes, for files the browser gives no type (no extension)
    const starts = (...b) => b.every((v, k) => bytes[k] === v);
    if (starts(0x89, 0x50, 0x4e, 0x47)) return "image/png";
    if (starts(0xff, 0xd8, 0xff)) return "image/jpeg";
    if (starts(0x47, 0x49, 0x46, 0x38)) return "image/gif";
    if (starts(0x52, 0x49, 0x46, 0x46) && bytes[8] === 0x57 && bytes[9] === 0x45 && bytes[10] === 0x42) return "image/webp";
    if (starts(0x42, 0x4d)) return "image/bmp";
    if (starts(0x49, 0x49, 0x2a, 0x00) || starts(0x4d, 0x4d, 0x00, 0x2a)) return "image/tiff";
    return "";
  }

  function pixelSize(bytes) {
    // [width, height] from an image file's header (PNG, GIF, BMP, JPEG, WebP), else null: to say
    // why the browser could not show a valid but huge image
    const u16 = (i, le) => (le ? bytes[i] | bytes[i + 1] << 8 : bytes[i] << 8 | bytes[i + 1]);
    const u32 = (i, le) => (le ? u16(i, true) + u16(i + 2, true) * 65536 : u16(i) * 65536 + u16(i + 2));
    const type = sniff(bytes);
    const ihdr = bytes[12] === 0x49 && bytes[13] === 0x48 && bytes[14] === 0x44 && bytes[15] === 0x52;
    if (type === "image/png" && bytes.length >= 24 && ihdr) return [u32(16), u32(20)];
    if (type === "image/gif" && bytes.length >= 10) return [u16(6, true), u16(8, true)];
    if (type === "image/bmp" && bytes.length >= 26) return [u32(18, true), Math.abs(u32(22, true) | 0)];
    if (type === "image/webp" && bytes.length >= 25) {
      const chunk = String.fromCharCode(bytes[12], bytes[13], bytes[14], bytes[15]);
      if (chunk === "VP8X" && bytes.length >= 30) {   // 24-bit sizes less one
        return [1 + bytes[24] + (bytes[25] << 8) + (bytes[26] << 16), 1 + bytes[27] + (bytes[28] << 8) + (bytes[29] << 16)];
      }
      if (chunk === "VP8L" && bytes[20] === 0x2f) {   // lossless: 14-bit sizes less one, packed
        const b = bytes[21] | bytes[22] << 8 | bytes[23] << 16 | bytes[24] << 24;
        return [1 + (b & 0x3fff), 1 + ((b >>> 14) & 0x3fff)];
      }
      if (chunk === "VP8 " && bytes.length >= 30) return [u16(26, true) & 0x3fff, u16(28, true) & 0x3fff];   // lossy
    }
    if (type === "image/jpeg") {
      for (let i = 2; i + 9 < bytes.length && bytes[i] === 0xff;) {
        const marker = bytes[i + 1];
        if (marker >= 0xc0 && marker <= 0xcf && ![0xc4, 0xc8, 0xcc].includes(marker)) return [u16(i + 7), u16(i + 5)];
        i += 2 + u16(i + 2);
      }
    }
    return null;
  }

  function sentBytes() {
    // the files this conversation sends with every request, as base64 in the body
    let n = 0;
    current.messages.forEach((m) => { if (m.role === "user") m.files.forEach((f) => { n += f.url.length; }); });
    pending.forEach((f) => { n += f.url.length; });
    return n;
  }

  let adding = Promise.resolve();
  function addFiles(files) {
    // one batch at a time: files keep the order they came in
    adding = adding.then(() => addNow(files)).catch((e) => fileNote(["The files could not be read (" + e.message + ")."]));
    return adding;
  }

  async function addNow(files) {
    if (!props) {
      fileNote(["The server has not described its model yet (is it running? does it want an API key?); try again."]);
      return;
    }
    const notes = [];
    for (const f of files) {
      const name = f.name || "pasted image";
      if (!props.images) {
        notes.push(name + ": this model (" + props.family + ") takes text only; send the question without files.");
        continue;
      }
      let type = f.type;
      if (!type || type === "application/octet-stream") type = sniff(new Uint8Array(await f.slice(0, 16).arrayBuffer()));
      let kind = IMAGE_MIME.includes(type) ? "image" : type.startsWith("video/") ? "video" : null;
      if (kind === null) {
        notes.push(name + " is not an image" + (props.video ? " or a video" : "") + "; choose a " + IMAGE_TYPES + " file"
                   + (props.video ? ", or a video (MP4, WebM ...)" : "") + ".");
        continue;
      }
      if (type === "image/gif") {
        const animated = gifFrames(new Uint8Array(await f.arrayBuffer())) > 1;
        if (animated && props.video) kind = "video";
        else if (animated) notes.push(name + ": this model takes no video, so only the GIF's first frame is sent.");
      }
      if (kind === "video" && !props.video) {
        notes.push(name + ": this model (" + props.family + ") takes no video; attach still images instead.");
        continue;
      }
      if (f.size * 4 / 3 > props.max_body) {
        notes.push(name + " is " + (f.size / 1e6).toFixed(1) + " MB; the server takes requests up to "
                   + (props.max_body / 1e6 * 3 / 4).toFixed(1) + " MB of files; choose a smaller one.");
        continue;
      }
      if (sentBytes() + f.size * 4 / 3 > props.max_body) {   // every turn's files go with each request
        notes.push(name + ": with the files already in this conversation, the requests would pass the server's "
                   + (props.max_body / 1e6 * 3 / 4).toFixed(1) + " MB; start a new chat for it, or choose a smaller one.");
        continue;
      }
      let url;
      try {
        url = await readAs(type === f.type ? f : new Blob([f], { type }), "readAsDataURL");
      } catch (e) {
        notes.push(name + " could not be read (" + e.message + ").");
        continue;
      }
      // TIFF: the server reads it, the browser cannot show it (it is checked there)
      const size = kind === "image" ? pixelSize(new Uint8Array(await f.slice(0, 1 << 16).arrayBuffer())) : null;
      if (size && size[0] * size[1] > props.max_image_pixels) {   // the server would refuse it
        notes.push(name + " is " + size[0] + "x" + size[1] + " pixels; the server takes at most "
                   + props.max_image_pixels + " pixels per request: choose a smaller image.");
        continue;
      }
      if (kind === "image" && type !== "image/tiff" && !(await decodes(url, kind))) {
        notes.push(name + " could not be read as an image (damaged, or not the " + IMAGE_TYPES + " it claims to be"
                   + (size ? ", or too large for this browser at " + size[0] + "x" + size[1] + " pixels" : "") + ").");
        continue;
      }
      pending.push({ kind, name, mime: type, url });
    }
    fileNote(notes);
    renderPending();
  }

  function renderPending() {
    const box = $("pending");
    box.replaceChildren();
    pending.forEach((f, i) => box.append(removable(f, () => { pending.splice(i, 1); renderPending(); })));
  }

  $("file-input").addEventListener("change", (e) => {
    addFiles([...e.target.files]);
    e.target.value = "";
  });
  document.addEventListener("paste", (e) => {
    const files = [...(e.clipboardData ? e.clipboardData.files : [])];
    if (files.length) {
      e.preventDefault();
      addFiles(files);
    }
  });
  let dragDepth = 0;
  document.addEventListener("dragenter", (e) => {
    if (!e.dataTransfer || ![...e.dataTransfer.types].includes("Files")) return;
    dragDepth++;
    $("drop-hint").hidden = false;
  });
  document.addEventListener("dragleave", () => {
    if (--dragDepth <= 0) { dragDepth = 0; $("drop-hint").hidden = true; }
  });
  document.addEventListener("dragover", (e) => e.preventDefault());
  document.addEventListener("drop", (e) => {
    e.preventDefault();
    dragDepth = 0;
    $("drop-hint").hidden = true;
    if (e.dataTransfer && e.dataTransfer.files.length) addFiles([...e.dataTransfer.files]);
  });

  // -- settings ------------------------------------------------------------------------------------
  $("settings-button").addEventListener("click", () => {
    $("set-system").value = settings.system || "";
    FIELDS.forEach((f) => { $("set-" + f).value = settings[f] ?? ""; });
    $("settings").returnValue = "";
    $("settings").showModal();
  });
  $("settings-reset").addEventListener("click", () => {
    FIELDS.forEach((f) => { $("set-" + f).value = ""; });
  });
  $("settings-cancel").addEventListener("click", () => $("settings").close(""));
  $("settings").addEventListener("close", () => {
    if ($("settings").returnValue !== "save") return;   // Escape or Cancel: nothing changes
    settings.system = $("set-system").value;
    FIELDS.forEach((f) => {
      const v = $("set-" + f).value.trim();
      if (v === "" || !Number.isFinite(Number(v))) delete settings[f];
      else settings[f] = v;
    });
    localStorage.setItem(SETTINGS, JSON.stringify(settings));
  });
  $("thinking").addEventListener("change", () => {
    settings.thinking = $("thinking").checked;
    localStorage.setItem(SETTINGS, JSON.stringify(settings));
  });

  // -- start ---------------------------------------------------------------------------------------
  show(conversations[0] || newConversation());
  loadProps().then(() => { if (props) renderMessages(); });
})();
