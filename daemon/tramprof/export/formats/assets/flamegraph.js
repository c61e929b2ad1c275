// tramprof flame graph: draws the tree embedded in #flame-data as absolutely
// positioned divs (root at the top, callees below), only those at least half a
// pixel wide, so large profiles stay fast. Frame names come from the profiled
// programs (perf maps, symbol tables) and are only ever set as textContent.
(function () {
  "use strict";

  var ROW = 18;            // px per stack level
  var MIN_WIDTH = 0.5;     // narrower frames (and their callees) are not drawn
  var MIN_LABEL = 36;      // frames at least this wide get their name written in

  var data = JSON.parse(document.getElementById("flame-data").textContent);
  var root = data.tree;
  var flame = document.getElementById("flame");
  var tip = document.getElementById("tip");
  var search = document.getElementById("search");
  var matched = document.getElementById("matched");
  var status = document.getElementById("zoom-status");
  var elementNode = new WeakMap();
  var zoomed = root;
  var query = "";
  var maxDepth = 0;

  // Parents and depths, iteratively: stacks can be hundreds of frames deep.
  (function annotate() {
    root.parent = null;
    root.depth = 0;
    var work = [root];
    while (work.length) {
      var node = work.pop();
      if (node.depth > maxDepth) maxDepth = node.depth;
      var children = node.children || [];
      for (var i = 0; i < children.length; i++) {
        children[i].parent = node;
        children[i].depth = node.depth + 1;
        work.push(children[i]);
      }
    }
  })();

  function isMarker(name) {
    return name.length > 1 && name.charAt(0) === "[" && name.charAt(name.length - 1) === "]";
  }

  // FNV-1a, so a function keeps its colour across pages and zoom levels.
  function hash(text) {
    var h = 0x811c9dc5;
    for (var i = 0; i < text.length; i++) {
      h ^= text.charCodeAt(i);
      h = Math.imul(h, 0x01000193) >>> 0;
    }
    return h;
  }

  function colour(node) {
    if (node.depth === 0) return "rgb(190, 196, 210)";
    if (isMarker(node.name)) return "rgb(195, 195, 195)";
    var h = hash(node.name);
    if (node.depth === 1) {  // processes: blues
      return "rgb(" + (100 + (h & 63)) + ", " + (165 + ((h >>> 6) & 31)) + ", " +
        (205 + ((h >>> 11) & 31)) + ")";
    }
    // Code: the classic warm flame palette.
    return "rgb(" + (205 + (h % 50)) + ", " + ((h >>> 8) % 200) + ", " +
      ((h >>> 16) % 55) + ")";
  }

  function percent(value, of) {
    if (!of) return "0%";
    var p = 100 * value / of;
    return (p >= 10 ? p.toFixed(1) : p.toPrecision(2)) + "%";
  }

  function cpuTime(samples) {
    var seconds = samples * data.period_ns / 1e9;
    if (seconds >= 1) return seconds.toFixed(2) + " s";
    return (seconds * 1000).toFixed(1) + " ms";
  }

  function matches(node) {
    return query !== "" && node.depth > 0 && node.name.toLowerCase().indexOf(query) !== -1;
  }

  function addFrame(fragment, node, x, width, extraClass) {
    var el = document.createElement("div");
    el.className = extraClass ? "frame " + extraClass : "frame";
    if (matches(node)) el.classList.add("match");
    el.style.left = x + "px";
    el.style.width = (width > 2 ? width - 1 : width) + "px";
    el.style.top = node.depth * ROW + "px";
    el.style.background = colour(node);
    if (width >= MIN_LABEL) el.textContent = node.name;
    elementNode.set(el, node);
    fragment.appendChild(el);
  }

  function render() {
    var width = flame.clientWidth;
    var fragment = document.createDocumentFragment();
    var drawn = 0;
    for (var a = zoomed.parent; a; a = a.parent) {
      addFrame(fragment, a, 0, width, "ancestor");
      drawn++;
    }
    var scale = width / zoomed.value;
    var work = [zoomed];
    var xs = [0];
    while (work.length) {
      var node = work.pop();
      var x = xs.pop();
      var w = node.value * scale;
      if (w < MIN_WIDTH) continue;
      addFrame(fragment, node, x, w, "");
      drawn++;
      var children = node.children || [];
      for (var i = 0; i < children.length; i++) {
        work.push(children[i]);
        xs.push(x);
        x += children[i].value * scale;
      }
    }
    flame.style.height = (maxDepth + 1) * ROW + "px";
    flame.replaceChildren(fragment);
    flame.dataset.frames = String(drawn);
    flame.dataset.zoom = zoomed.name;
    status.textContent = zoomed === root ? "" :
      "Zoomed into " + zoomed.name + " (" + percent(zoomed.value, root.value) + ")";
  }

  function zoomTo(node) {
    zoomed = node;
    render();
  }

  // Share of all samples under matching frames, each sample counted once.
  function matchedSamples() {
    var sum = 0;
    var work = [root];
    while (work.length) {
      var node = work.pop();
      if (matches(node)) {
        sum += node.value;
        continue;
      }
      var children = node.children || [];
      for (var i = 0; i < children.length; i++) work.push(children[i]);
    }
    return sum;
  }

  function applySearch() {
    query = search.value.trim().toLowerCase();
    if (query === "") {
      matched.textContent = "";
    } else {
      var sum = matchedSamples();
      matched.textContent = "Matched: " + percent(sum, root.value) + " (" + sum + " samples)";
    }
    render();
  }

  function line(text, className) {
    var div = document.createElement("div");
    if (className) div.className = className;
    div.textContent = text;
    return div;
  }

  function showTip(node, event) {
    var parts = [
      line(node.name, "name"),
      line(node.value + " samples, " + cpuTime(node.value) + " CPU"),
      line(percent(node.value, root.value) + " of all samples"),
    ];
    if (zoomed !== root) parts.push(line(percent(node.value, zoomed.value) + " of " + zoomed.name));
    tip.replaceChildren.apply(tip, parts);
    tip.hidden = false;
    var x = event.clientX + 14;
    var y = event.clientY + 14;
    var box = tip.getBoundingClientRect();
    if (x + box.width > window.innerWidth) x = Math.max(0, event.clientX - box.width - 8);
    if (y + box.height > window.innerHeight) y = Math.max(0, event.clientY - box.height - 8);
    tip.style.left = x + "px";
    tip.style.top = y + "px";
  }

  function frameAt(event) {
    var el = event.target.closest ? event.target.closest(".frame") : null;
    return el ? elementNode.get(el) : undefined;
  }

  flame.addEventListener("mousemove", function (event) {
    var node = frameAt(event);
    if (node) showTip(node, event); else tip.hidden = true;
  });
  flame.addEventListener("mouseleave", function () { tip.hidden = true; });
  flame.addEventListener("click", function (event) {
    var node = frameAt(event);
    if (node) zoomTo(node);
  });
  document.getElementById("reset").addEventListener("click", function () { zoomTo(root); });
  search.addEventListener("input", applySearch);
  document.addEventListener("keydown", function (event) {
    if (event.key === "Escape") {
      if (document.activeElement === search && search.value !== "") {
        search.value = "";
        applySearch();
      } else {
        zoomTo(root);
      }
    }
  });
  var pending = false;
  window.addEventListener("resize", function () {
    if (pending) return;
    pending = true;
    window.requestAnimationFrame(function () { pending = false; render(); });
  });

  if (root.value > 0) {
    render();
  } else {
    flame.hidden = true;
    document.getElementById("empty").hidden = false;
  }
  document.body.dataset.ready = "1";
})();
