// The one DOM helper the page's modules share: an element with properties and children (text
// given as a child becomes a text node, never HTML).
export function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  Object.assign(node, props);
  node.append(...children);
  return node;
}
